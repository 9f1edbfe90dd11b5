"""Shared fixtures: tiny random checkpoints made offline with transformers (no network), and the
end-to-end tests' real stacks (processes on 127.0.0.1)."""
from __future__ import annotations

import os
import sys

# Triton's interpreter runs kernels on CPU tensors; it must be chosen before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest

from kvtransfer import TRANSPORTS

# The process helpers (service_procs, stack) serve the end-to-end tests of every directory; their
# asserts explain themselves as the tests' do.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "services"))
pytest.register_assert_rewrite("service_procs", "stack")

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Cached per session: make(arch, **kwargs) -> checkpoint directory."""
    from engine.tiny import make_tiny_model

    made: dict = {}

    def make(arch: str = "llama", **kwargs) -> str:
        key = (arch, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])).__repr__())
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            made[key] = make_tiny_model(path, arch=arch, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="session")
def tiny_lora_factory(tmp_path_factory):
    """make(base, seed, rank=8, targets=ALL_TARGETS, **LoraConfig kwargs) -> a PEFT adapter folder
    (saved by peft's save_pretrained) of random weights: both A and B drawn, so it changes the
    model's answers (PEFT starts B at zero). Cached per session."""
    made: dict = {}

    def make(base: str, seed: int, rank: int = 8, targets=ALL_TARGETS, **kwargs) -> str:
        key = (base, seed, rank, tuple(targets), tuple(sorted(kwargs.items())))
        if key not in made:
            from peft import LoraConfig, get_peft_model
            from transformers import AutoModelForCausalLM

            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            config = LoraConfig(r=rank, lora_alpha=kwargs.pop("lora_alpha", 2 * rank), target_modules=list(targets),
                                lora_dropout=0.0, **kwargs)
            peft_model = get_peft_model(model, config)
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_" in name:
                        param.normal_(0.0, 0.3)
            path = str(tmp_path_factory.mktemp(f"lora-{seed}"))
            peft_model.save_pretrained(path)
            made[key] = path
        return made[key]

    return make


@pytest.fixture(scope="session")
def e2e_model(tiny_model_factory) -> str:
    """The model of every end-to-end stack: small and fast, with a 512-token context."""
    return tiny_model_factory("llama", max_position_embeddings=512)


@pytest.fixture(scope="session")
def e2e_stacks(e2e_model):
    """The session's shared stacks by spec (stack.StackSpec); each stops with exit code 0 at the end."""
    from stack import Stacks

    stacks = Stacks(e2e_model)
    yield stacks
    stacks.stop_all()


@pytest.fixture(scope="session", params=TRANSPORTS)
def transport_stack(request, e2e_stacks):
    """Router, prefill and decode over each KV transport in turn. The parameter is session-scoped, so
    pytest runs each transport's tests together; tcp's stack stays for the tcp-only tests (tcp_stack),
    the others stop once their tests are done."""
    from stack import StackSpec

    spec = StackSpec.shared(request.param)
    yield e2e_stacks.get(spec)
    if spec != StackSpec.shared("tcp"):
        e2e_stacks.stop(spec)


@pytest.fixture
def tcp_stack(e2e_stacks):
    """The shared tcp stack (two prefills, two decodes, a router), idle."""
    from stack import StackSpec

    stack = e2e_stacks.get(StackSpec.shared("tcp"))
    stack.wait_idle()
    return stack


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a shared stack reports the stack's service logs."""
    report = yield
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            logs = getattr(value, "service_logs", None)
            if callable(logs):
                report.sections.append(("pdserve service logs", logs()))
    return report
