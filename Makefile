# pdserve — the verbs. Every target bootstraps the virtualenv it needs (idempotent), after
# scripts/system-deps.sh has checked the system packages it needs (a C++ compiler, Python's
# headers; prometheus for `make test`): as root with apt-get it installs what is missing, else it
# prints the command to run and stops before anything else runs.
#
# torch: on CPU-only machines we install the CPU build (torch==2.13.0); an unpinned
# `torch` would pull a multi-GB CUDA build. On a GPU machine, either install a CUDA
# torch into .venv first (it is kept: we only install torch when none imports), or
# run e.g. `make test TORCH_SPEC='torch==2.13.0+cu128 --extra-index-url <your CUDA wheel index>'`.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
TORCH_SPEC ?= torch==2.13.0
# `make test TESTS=tests/router`: a part of the suite.
TESTS := tests
export PYTHONUNBUFFERED := 1

.PHONY: system-deps venv proto run test bench-engine bench-tp bench-kvtransfer bench-kernels-cpu bench-kernels-gpu bench-quant bench-pd bench-router bench-routing bench-decoding bench-pd-sweep bench-sim-cluster sim-validate soak gpu-check chart chart-golden image clean
IMAGE ?= ghcr.io/pdserve/pdserve:0.1.0

system-deps:
	@PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/system-deps.sh $(SYSTEM_NEEDS)

venv: $(STAMP)

# Order-only: the check runs first every time, but never makes the venv out of date.
$(STAMP): pyproject.toml | system-deps
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@$(VPY) -m pip install -q --upgrade pip
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH_SPEC)
	$(VPY) -m pip install -q -e ".[test,triton,ucx]"
	@touch $@

# Python code is generated from proto/ (never edited by hand) into services/api/pdserve/v1.
GENERATED := services/api/pdserve/v1/pdserve_pb2_grpc.py
proto: $(GENERATED)

$(GENERATED): $(wildcard proto/pdserve/v1/*.proto) $(STAMP)
	$(VPY) -m services.api.generate

run: $(STAMP) $(GENERATED)
	$(VENV)/bin/pdserve up --model tiny --prefill 1 --decode 1 --demo

test: SYSTEM_NEEDS := prometheus
test: $(STAMP) $(GENERATED)
	$(VPY) -m pytest -q -p no:cacheprovider $(TESTS)

bench-engine: $(STAMP)
	$(VPY) bench/engine_bench.py

# TP=2 (one thread per rank) against TP=1 (two threads) on the CPU, and gloo's all-reduce cost.
bench-tp: $(STAMP)
	$(VPY) -m bench.tp_bench

bench-kvtransfer: $(STAMP)
	$(VPY) bench/kvtransfer_bench.py

# The CPU decode attention kernel against the torch path, on caches past the L3 (~1 min).
bench-kernels-cpu: $(STAMP)
	$(VPY) -m bench.cpu_attention_bench

bench-kernels-gpu: $(STAMP)
	$(VPY) bench/kernels_gpu.py

# INT8 W8A8 on the CPU (torch._int_mm) against the dense float32 model and W8A16 (~3 min).
bench-quant: $(STAMP)
	$(VPY) -m bench.quant_bench

# The GPU half, on a machine with one CUDA GPU: with $(PYTHON) as it is (its CUDA torch and the
# project's dependencies; a fresh venv here would get the CPU torch). One report file, < 8 minutes.
gpu-check:
	@test -f $(GENERATED) || $(PYTHON) -m services.api.generate
	$(PYTHON) bench/gpu_check.py --report docs/gpu-check.json

bench-pd: $(STAMP) $(GENERATED)
	$(VPY) bench/pd_bench.py

bench-router: $(STAMP) $(GENERATED)
	$(VPY) bench/router_bench.py

# KV-aware routing (least_load vs kv_aware) and conditional disaggregation (always/never/conditional).
bench-routing: $(STAMP) $(GENERATED)
	$(VPY) bench/routing_bench.py

# Decoding features against pdserve without them, same run: structured outputs (guided_vs_free_throughput_ratio)
# and n-gram speculative decoding (spec_itl_speedup_b1, b8, and the nothing-accepted ratio).
bench-decoding: $(STAMP) $(GENERATED)
	$(VPY) -m bench.guided_bench
	$(VPY) -m bench.spec_bench

# Where disaggregation pays (docs/planning.md): the measured sweep (ISL:OSL x SLO, the plan's choice against
# colocated and vLLM's CPU build), cluster scale by simulation on GPU rooflines, and the simulator's validation.
bench-pd-sweep: $(STAMP) $(GENERATED)
	$(VPY) -m bench.pd_sweep

bench-sim-cluster: $(STAMP) $(GENERATED)
	$(VPY) -m bench.sim_cluster

sim-validate: $(STAMP) $(GENERATED)
	$(VPY) -m bench.sim_validate

# Faults under twice the local stack's capacity (< 10 minutes); exits 1 if anything is lost.
# `make soak SOAK_ARGS="--duration 60"`: shorter; bench/soak.py --help for the knobs.
soak: $(STAMP) $(GENERATED)
	$(VPY) bench/soak.py $(SOAK_ARGS)

# The Helm chart: its tests (render + lint with Helm 3 and 4, strict schema validation), then a package.
chart: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider tests/helm
	mkdir -p build/chart && $$($(VPY) helm/fetch_helm.py 3) package helm/pdserve -d build/chart

chart-golden: $(STAMP)
	PDSERVE_UPDATE_GOLDEN=1 $(VPY) -m pytest -q -p no:cacheprovider tests/helm/test_chart_golden.py

image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) build .cache
