"""--gpu-memory-utilization (vLLM's): the KV cache is what that share of the device's memory
leaves after the weights and a profiled step. The arithmetic and the profiled step run here on
the CPU through a scripted memory probe (CUDA's readings are the probe's only device part); the
engine then serves token-exact with the cache it sized."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import CacheConfig
from engine.memory import GIB, MemoryBudget, check_start, default_size_warning

MIB = 1 << 20


class ScriptedMemory:
    """free_total() answers the scripted readings in turn; the peak is scripted too."""

    def __init__(self, total: int, frees: list[int], peak: int) -> None:
        self.total, self.frees, self.peak = total, list(frees), peak
        self.calls: list[str] = []

    def free_total(self) -> tuple[int, int]:
        self.calls.append("free_total")
        return self.frees.pop(0), self.total

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def peak_over_current(self) -> int:
        self.calls.append("peak_over_current")
        return self.peak

    def release(self) -> None:
        self.calls.append("release")


def test_vllms_rule():
    b = MemoryBudget(total=80 * GIB, free_at_start=79 * GIB, free_after=63 * GIB, peak_over_after=2 * GIB,
                     utilization=0.9)
    assert b.requested == int(72 * GIB) and b.non_kv == 18 * GIB and b.kv_bytes() == int(54 * GIB)
    assert "KV cache 54.00 GiB" in b.describe()
    check_start(79 * GIB, 80 * GIB, 0.9)
    with pytest.raises(ValueError, match="only 40.00 GiB are free"):
        check_start(40 * GIB, 80 * GIB, 0.9)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        check_start(79 * GIB, 80 * GIB, 1.5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpu_memory_utilization=0.0), r"in \(0, 1\]"), (dict(gpu_memory_utilization=1.2), r"in \(0, 1\]"),
    (dict(gpu_memory_utilization=0.9, kv_cache_memory_bytes=GIB), "give one"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)


def test_the_engine_sizes_its_cache_and_serves(tiny_llama, monkeypatch):
    probe = ScriptedMemory(total=200 * MIB, frees=[190 * MIB, 160 * MIB], peak=12 * MIB)
    monkeypatch.setattr("engine.model_runner.device_memory", lambda device: probe)
    llm = LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.3, max_num_batched_tokens=64, max_num_seqs=8)
    runner = llm.engine.runner
    # 0.3 x 200 MiB = 60 MiB, less 30 MiB the weights took and the step's 12 MiB peak: 18 MiB.
    assert runner.memory_budget.kv_bytes() == int(0.3 * 200 * MIB) - 30 * MIB - 12 * MIB
    assert runner.num_blocks == runner.memory_budget.kv_bytes() // runner.bytes_per_block()
    assert runner.kv_caches[0].shape[1] == runner.num_blocks
    assert probe.calls == ["free_total", "reset_peak", "peak_over_current", "release", "free_total"]
    assert llm.engine.stats()["num_blocks"] == runner.num_blocks  # the scheduler's block pool
    # The profiled step left nothing behind: the engine answers as one sized by hand.
    prompts = [[5, 6, 7, 8], list(range(40, 140))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(tiny_llama, device="cpu", num_blocks=64).generate(prompts, params)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    llm.engine.check_integrity(expect_all_free=True)


def test_the_profiled_step_runs_the_whole_token_budget(tiny_llama, monkeypatch):
    """A step may run max_num_batched_tokens tokens over several prompts when that is more than
    max_model_len: the profiled step does too (vLLM's rule), its prompts no longer than
    max_model_len, as many as the budget needs and max_num_seqs allows; then the engine serves."""
    from engine.model_runner import ModelRunner

    monkeypatch.setattr("engine.model_runner.device_memory",
                        lambda device: ScriptedMemory(total=200 * MIB, frees=[190 * MIB, 160 * MIB], peak=12 * MIB))
    steps = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, so, *a, **k: (
        steps.append(list(so.num_scheduled_tokens)), execute(self, so, *a, **k))[1])
    LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.3, max_num_batched_tokens=64, max_model_len=24,
        max_num_seqs=2)
    assert steps[-1] == [24, 24]  # two prompts at most: the most two rows can be
    llm = LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.3, max_num_batched_tokens=64, max_model_len=24,
              max_num_seqs=8)
    assert steps[-1] == [22, 21, 21]  # 64 tokens, prompts of 24 at most
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(40, 55))]
    want = LLM(tiny_llama, device="cpu", num_blocks=64, max_model_len=24).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [o.outputs[0].token_ids for o in want]
    llm.engine.check_integrity(expect_all_free=True)


def test_a_draft_model_is_inside_the_share(tiny_llama, tiny_model_factory, monkeypatch):
    """A speculative draft's weights load before the second reading (counted as weights), its
    longest forward is in the profiled step, and its cache is part of the KV cache the share
    leaves (a block's bytes are both models')."""
    from engine.spec_decode.draft_model import DraftModel

    probe = ScriptedMemory(total=200 * MIB, frees=[190 * MIB, 160 * MIB], peak=12 * MIB)
    monkeypatch.setattr("engine.model_runner.device_memory", lambda device: probe)
    load, forward = DraftModel.load, DraftModel.forward
    monkeypatch.setattr(DraftModel, "load",
                        lambda self, *a, **k: (probe.calls.append("draft loaded"), load(self, *a, **k)))
    monkeypatch.setattr(DraftModel, "forward", lambda self, tokens, *a, **k: (
        probe.calls.append(f"draft forward of {sum(map(len, tokens))}"), forward(self, tokens, *a, **k))[1])
    draft = tiny_model_factory("llama", num_layers=1, num_kv_heads=1)
    llm = LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.3, max_num_batched_tokens=64, max_num_seqs=8,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
    runner = llm.engine.runner
    # The profiled step runs the draft's longest catch-up forward (the step budget's 64 tokens) too.
    assert probe.calls == ["free_total", "draft loaded", "reset_peak", "draft forward of 64", "peak_over_current",
                           "release", "free_total"]
    held = sum(c.numel() * c.element_size() for c in [*runner.kv_caches, *runner.draft.kv_caches])
    assert held == runner.num_blocks * runner.bytes_per_block() <= runner.memory_budget.kv_bytes()
    assert runner.memory_budget.kv_bytes() - held < runner.bytes_per_block()
    assert runner.draft.kv_caches[0].shape[1] == runner.num_blocks


def test_too_little_room_and_other_devices(tiny_llama, monkeypatch):
    probe = ScriptedMemory(total=100 * MIB, frees=[100 * MIB, 60 * MIB], peak=10 * MIB)
    monkeypatch.setattr("engine.model_runner.device_memory", lambda device: probe)
    with pytest.raises(ValueError, match="no room for a KV cache"):
        LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.5, max_num_batched_tokens=64)
    busy = ScriptedMemory(total=100 * MIB, frees=[30 * MIB], peak=0)
    monkeypatch.setattr("engine.model_runner.device_memory", lambda device: busy)
    with pytest.raises(ValueError, match="another process holds the rest"):
        LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.5)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="on cpu give --kv-cache-memory-gb or --num-blocks"):
        LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.9)
    # An explicit block count wins over the share (as vLLM's num_gpu_blocks_override).
    assert LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.9, num_blocks=32).engine.runner.num_blocks == 32


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_connector_registers_the_cache_it_sized(tiny_llama, monkeypatch, transport):
    """P/D engines sized by the share: the KV connector gets the final cache (shared memory is
    registered with its transport), not the profiled step's, and the transfers stay exact."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from services.common.kv_connector import KVConnectorConfig
    from services.common.role import Role

    monkeypatch.setattr("engine.model_runner.device_memory",
                        lambda device: ScriptedMemory(total=200 * MIB, frees=[190 * MIB, 160 * MIB], peak=12 * MIB))
    prompts = [[5, 6, 7, 8], list(range(40, 140))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, device="cpu", num_blocks=64).generate(prompts, params)]
    sized = dict(device="cpu", detokenize=False, gpu_memory_utilization=0.3, max_num_batched_tokens=64,
                 max_num_seqs=8)

    async def main():
        prefill = await AsyncEngine.create(tiny_llama, **sized, kv_connector_factory=KVConnectorConfig(
            transport, Role.PREFILL, b"secret", "prefill-0"))
        decode = await AsyncEngine.create(tiny_llama, **sized, kv_connector_factory=KVConnectorConfig(
            transport, Role.DECODE, b"secret", "decode-0"))
        try:
            got = []
            for prompt in prompts:
                first = None
                async for out in prefill.generate(prompt, params, prefill_only=True, publish_kv=True):
                    first = out
                token = first.outputs[0].token_ids[0]
                rest = [t async for out in decode.generate(prompt, params, remote_kv=first.kv_handle,
                                                           first_token_id=token) for t in out.delta_token_ids]
                got.append([token, *rest])
            runner = prefill.client.core.runner
            assert runner.kv_caches[0].shape[1] == runner.num_blocks == 18 * MIB // runner.bytes_per_block()
            return got
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    assert asyncio.run(main()) == want


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_share_is_kept_and_the_engine_serves(tiny_llama):
    """The real probe: the cache the share leaves, the same tokens as a cache sized by hand, and
    the engine's memory (what the allocator reserved at its peak, plus the CUDA graphs it
    captured) within the share."""
    import torch

    llm = LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.5, max_num_seqs=32)
    budget = llm.engine.runner.memory_budget
    assert budget is not None and llm.engine.runner.num_blocks > 1000, budget.describe()
    prompts = [[5, 6, 7, 8], list(range(40, 140))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()  # before the reference engine loads its own copy
    assert budget.free_at_start - free <= budget.requested * 1.02, budget.describe()
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, device="cuda", num_blocks=64,
                                                enforce_eager=True).generate(prompts, params)]
    assert got == want


def test_a_gpu_engine_left_at_the_default_size_is_told():
    import torch

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    said = default_size_warning(cuda, CacheConfig(), 512, 16)
    assert "1 GiB default (512 blocks, 8192 tokens)" in said and "--gpu-memory-utilization" in said
    for cache in (CacheConfig(num_blocks=64), CacheConfig(kv_cache_memory_bytes=GIB),
                  CacheConfig(gpu_memory_utilization=0.9)):
        assert default_size_warning(cuda, cache, 512, 16) is None
    assert default_size_warning(cpu, CacheConfig(), 512, 16) is None  # the CPU's default is a fine size
