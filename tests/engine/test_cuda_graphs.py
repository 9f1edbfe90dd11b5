"""Decode steps through padded persistent buffers (CUDA graphs on a GPU) give exactly the tokens of
eager steps at their own batch size; the padding rows write nothing."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import SchedulerConfig
from engine.scheduler import SchedulerOutput
from services.common.engine_flags import add_engine_parser
from services.common.engine_host import engine_kwargs
from services.common.role import Role

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts, half of them sharing a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(40)]
    return [(prefix if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
            for i in range(n)]


def generate(llm: LLM, batch: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    llm.engine.check_integrity(expect_all_free=True)
    return out


@pytest.mark.parametrize("num_prompts", [3, 5, 13])
@pytest.mark.parametrize("cache", ["plain", "preemption"])
def test_padded_decode_is_token_exact(tiny_llama, num_prompts, cache, device):
    kwargs = dict(device=device, max_num_seqs=16)
    if cache == "preemption":
        kwargs["num_blocks"] = 12  # 16-token blocks: 13 prompts of up to 90 tokens cannot all fit
    eager = LLM(tiny_llama, enforce_eager=True, **kwargs)
    # Sizes given explicitly: without a GPU the engine pads only then (on CUDA it pads by default).
    padded = LLM(tiny_llama, cuda_graph_sizes=[16], **kwargs)
    batch = prompts(eager.engine.vocab_size, num_prompts)
    # Twice: the second pass hits the prefix cache for every full block.
    for _ in range(2):
        assert generate(padded, batch) == generate(eager, batch)
    stats = padded.engine.stats()
    assert stats["decode_buffer_steps"] > 0, "decode steps went through the padded buffers"
    assert eager.engine.stats()["decode_buffer_steps"] == 0
    assert padded.engine.kv_cache_manager.prefix_hits > 0
    if cache == "preemption":
        assert padded.engine.scheduler.num_preemptions > 0
    if device == "cpu":
        assert stats["cuda_graph_replays"] == 0 and padded.engine.runner.cuda_graphs_off_reason == "no CUDA device"


def test_padding_rows_write_no_kv(tiny_llama):
    """A batch of 3 padded to 4: the cache changes exactly at the 3 real rows' slots."""
    llm = LLM(tiny_llama, num_blocks=8, cuda_graph_sizes=[4])
    core = llm.engine
    from engine.request import Request

    reqs = [Request(str(i), [5 + i] * (3 + i), SamplingParams(max_tokens=4)) for i in range(3)]
    for r in reqs:
        core.add_request(r)
    core.step()  # the prompts (a mixed batch: no padding)
    before = [c.clone() for c in core.runner.kv_caches]
    so = core.scheduler.schedule()
    assert so.total_num_scheduled_tokens == 3 == len(so.scheduled)
    core.runner.execute(so)
    assert core.runner.decode_graphs.num_steps == 1
    changed = set()
    for old, new in zip(before, core.runner.kv_caches):
        diff = (old != new).flatten(3).any(-1).any(0)  # [num_blocks, block_size]
        changed |= {int(b) * 16 + int(o) for b, o in diff.nonzero().tolist()}
    expected = {core.runner.block_ids[r.request_id][0] * 16 + r.num_computed_tokens for r in so.scheduled}
    assert changed == expected


def test_step_fed_by_previous_sampled_ids_equals_plain_step(tiny_llama):
    """The runner's async half: a step launched before the previous step's ids reached the CPU
    reads them on the device and computes what the plain next step computes."""
    llm = LLM(tiny_llama, num_blocks=16)
    core = llm.engine
    from engine.request import Request

    reqs = [Request(str(i), [7 + i] * (2 + 3 * i), SamplingParams(temperature=0.0, max_tokens=8)) for i in range(3)]
    for r in reqs:
        core.add_request(r)
    core.step()
    so = core.scheduler.schedule()
    first = core.runner.launch(so)
    ahead = core.runner.launch(SchedulerOutput(scheduled=list(so.scheduled), num_scheduled_tokens=[1] * 3,
                                               new_block_ids=[[], [], []]), prev=first)
    core.scheduler.update_from_output(so, core.runner.collect(first))
    fed = core.runner.collect(ahead).sampled_token_ids
    # The same step again, the plain way, from the known tokens (it rewrites the same KV slots).
    plain_so = SchedulerOutput(scheduled=list(so.scheduled), num_scheduled_tokens=[1] * 3, new_block_ids=[[], [], []])
    assert core.runner.execute(plain_so).sampled_token_ids == fed


def test_decode_batch_sizes():
    assert SchedulerConfig(max_num_seqs=40).decode_batch_sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    assert SchedulerConfig(max_num_seqs=256, cuda_graph_sizes=[32]).decode_batch_sizes == (1, 2, 4, 8, 16, 24, 32)
    assert SchedulerConfig(max_num_seqs=8, cuda_graph_sizes=[3, 6, 12]).decode_batch_sizes == (3, 6)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        SchedulerConfig(cuda_graph_sizes=[0])


def test_flags_reach_the_engine_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="cmd"), Role.DECODE, "decode")
    args = parser.parse_args(["decode", "--enforce-eager", "--cuda-graph-sizes", "1", "8", "--async-scheduling"])
    kwargs = engine_kwargs(args)
    assert (kwargs["enforce_eager"], kwargs["cuda_graph_sizes"], kwargs["async_scheduling"]) == (True, [1, 8], True)


@needs_cuda
def test_cuda_graphs_token_exact_against_eager(tiny_model_factory):
    path = tiny_model_factory(max_position_embeddings=1024)
    eager = LLM(path, device="cuda", enforce_eager=True, max_num_seqs=32)
    graphs = LLM(path, device="cuda", max_num_seqs=32)
    runner = graphs.engine.runner
    assert runner.cuda_graphs_off_reason is None
    assert graphs.engine.stats()["cuda_graphs_captured"] == len(graphs.config.scheduler.decode_batch_sizes)
    for n in (1, 3, 9, 30):
        batch = prompts(eager.engine.vocab_size, n, seed=n)
        assert generate(graphs, batch) == generate(eager, batch)
    assert graphs.engine.stats()["cuda_graph_replays"] > 0
    assert eager.engine.stats()["cuda_graph_replays"] == 0


@needs_cuda
def test_cuda_graphs_with_preemption_and_async_scheduling(tiny_model_factory):
    path = tiny_model_factory(max_position_embeddings=1024)
    kwargs = dict(device="cuda", max_num_seqs=16, num_blocks=12)
    eager = LLM(path, enforce_eager=True, **kwargs)
    fast = LLM(path, async_scheduling=True, **kwargs)
    batch = prompts(eager.engine.vocab_size, 13)
    assert generate(fast, batch) == generate(eager, batch)
    stats = fast.engine.stats()
    assert stats["cuda_graph_replays"] > 0 and stats["num_async_steps"] > 0 and stats["num_preemptions"] > 0
