# pdserve — the verbs. Every target bootstraps the virtualenv it needs (idempotent).
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
export PYTHONUNBUFFERED := 1

.PHONY: venv proto run test bench-engine bench-kvtransfer bench-kernels-gpu bench-pd bench-router chart chart-golden image clean
IMAGE ?= ghcr.io/pdserve/pdserve:0.1.0

venv: $(STAMP)

$(STAMP): pyproject.toml
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

test: $(STAMP) $(GENERATED)
	$(VPY) -m pytest -q -p no:cacheprovider tests

bench-engine: $(STAMP)
	$(VPY) bench/engine_bench.py

bench-kvtransfer: $(STAMP)
	$(VPY) bench/kvtransfer_bench.py

bench-kernels-gpu: $(STAMP)
	$(VPY) bench/kernels_gpu.py

bench-pd: $(STAMP) $(GENERATED)
	$(VPY) bench/pd_bench.py

bench-router: $(STAMP) $(GENERATED)
	$(VPY) bench/router_bench.py

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
