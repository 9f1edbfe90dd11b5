"""Tensor-parallel prefill and decode engines joined by real KV connectors, one per rank: what a merged
handle names, a pull that fails on one rank only, a publish that fails on one rank only, and a handle
the decode's TP size cannot split."""
from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.kv_connector import KVConnectorOutput, KVConnectorWorker
from engine.request import Request, RequestStatus
from kvtransfer import KVHandle, KVLayout, KVShardRef, create_connector
from services.common.kv_connector import KVConnectorConfig
from services.common.role import Role
from services.prefill.kv_connector import PrefillConnectorScheduler
from service_procs import free_port
from test_disagg_engine import SECRET, disaggregated, transfers_settled

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(40, 90))  # 4 blocks


def tp_engine(model: str, role: Role, size: int, **kv) -> "asyncio.Future[AsyncEngine]":
    return AsyncEngine.create(model, detokenize=False, tensor_parallel_size=size,
                              kv_connector_factory=KVConnectorConfig("tcp", role, SECRET, role.value, **kv))


def model_layout(tp_size: int = 1, tp_rank: int = 0) -> KVLayout:
    """tiny_llama's KV cache: 2 layers, 2 KV heads of dim 16, float32."""
    return KVLayout.for_rank(2, 2, 16, 16, dtype="float32", tp_size=tp_size, tp_rank=tp_rank)


def test_tp2_prefill_ranks_serve_their_ports_and_one_rank_failing_means_recompute(tiny_llama):
    expected = LLM(tiny_llama).generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    port = free_port()

    async def main():
        prefill, decode = await asyncio.gather(tp_engine(tiny_llama, Role.PREFILL, 2, port=port),
                                               tp_engine(tiny_llama, Role.DECODE, 2))
        pcore, dcore = prefill.client.core, decode.client.core
        try:
            first = None
            async for out in prefill.generate(PROMPT, PARAMS, prefill_only=True, publish_kv=True):
                first = out
            handle = KVHandle.from_bytes(first.kv_handle)
            handle.verify(SECRET)
            # One handle naming both ranks: each its own engine id, heads, lease and port.
            assert [(s.rank, s.tp_size, s.engine_id, s.head_start, s.head_end) for s in handle.shards] == [
                (0, 2, "prefill-tp0", 0, 1), (1, 2, "prefill-tp1", 1, 2)]
            assert [s.endpoint for s in handle.shards] == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
            assert all(s.tag for s in handle.shards) and handle.block_ids and handle.num_blocks == 4
            # Another decode rank 1 gives prefill rank 1's lease back unread: the real decode's rank 1
            # then finds nothing to pull, its rank 0 pulls its head, and the prompt is recomputed.
            with create_connector("tcp", "decode", model_layout(2, 1), secret=SECRET, engine_id="other") as other:
                other.release(handle).result(timeout=10)
            tokens = [first.outputs[0].token_ids[0]]
            async for out in decode.generate(PROMPT, PARAMS, remote_kv=first.kv_handle, first_token_id=tokens[0]):
                tokens += out.delta_token_ids
            assert tokens == expected
            stats = dcore.stats()
            assert stats["kv_pull_failures"] == 1 and stats["kv_recomputed_fallbacks"] == 1
            assert stats.get("kv_pulls_finished", 0) == 0
            # Every prefill rank's lease ended (released by one decode rank or the other): blocks freed.
            await transfers_settled(pcore)
            assert pcore.scheduler.num_held_blocks == 0
            # And the next request goes through both ranks' pulls.
            assert await disaggregated(prefill, decode, PROMPT[::-1], PARAMS) == \
                LLM(tiny_llama).generate([PROMPT[::-1]], PARAMS)[0].outputs[0].token_ids
            await transfers_settled(pcore)
            assert pcore.scheduler.num_held_blocks == 0 and dcore.stats()["kv_pulls_finished"] == 1
            for core in (pcore, dcore):
                core.check_integrity(expect_all_free=True)
        finally:
            await asyncio.gather(prefill.shutdown(), decode.shutdown())

    asyncio.run(main())


def test_a_handle_the_decode_cannot_split_is_refused_and_the_prompt_recomputed(tiny_llama, caplog):
    expected = LLM(tiny_llama).generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    layout = model_layout()
    # Signed by the deployment, this model's layout, but from a "TP=3 prefill": 2 KV heads do not split 3 ways.
    refs = tuple(KVShardRef(r, 3, f"tcp://127.0.0.1:{free_port()}", 0, 1, f"p-tp{r}", b"t") for r in range(3))
    forged = KVHandle(request_id="r", engine_id="p-tp0", transport="tcp", endpoint=refs[0].endpoint,
                      block_ids=(0, 1, 2, 3), num_tokens=len(PROMPT), layout_fingerprint=layout.fingerprint,
                      lease_expiry=time.time() + 30, shards=refs, layout=layout.describe()).signed(SECRET)

    async def main():
        decode = await tp_engine(tiny_llama, Role.DECODE, 2)
        try:
            tokens = [expected[0]]
            with caplog.at_level(logging.WARNING):
                async for out in decode.generate(PROMPT, PARAMS, remote_kv=forged.to_bytes(), first_token_id=tokens[0]):
                    tokens += out.delta_token_ids
            assert tokens == expected
            stats = decode.client.core.stats()
            assert stats["kv_recomputed_fallbacks"] == 1 and stats.get("kv_pulls_started", 0) == 0
            assert "prefill TP=3 and decode TP=2 cannot exchange KV" in caplog.text
            decode.client.core.check_integrity(expect_all_free=True)
        finally:
            await decode.shutdown()

    asyncio.run(main())


class FakeRanks(KVConnectorWorker):
    """Two prefill ranks' worker sides as the TP driver's wrapper shows them to the scheduler side."""

    def __init__(self, publish_errors: tuple) -> None:
        self.publish_errors, self.calls, self.sending = publish_errors, [], []

    def allocate_kv_caches(self, spec, num_blocks):
        return []

    def start_load_kv(self, metadata):
        pass

    def get_finished(self):
        return KVConnectorOutput()

    def on_all_ranks(self, method, *args):
        self.calls.append((method, args))
        if method == "publish":
            return [(None, error) if error else (b"unused", None) for error in self.publish_errors]
        return [True for _ in self.publish_errors]

    def expect_sending(self, request_id):
        self.sending.append(request_id)


def test_a_publish_that_fails_on_one_rank_lets_the_others_go_and_sends_no_handle():
    ranks = FakeRanks((None, "BlockRangeError: block ids [9] outside [0, 8)"))
    link = SimpleNamespace(block_size=16, config=SimpleNamespace(secret=SECRET))
    scheduler = PrefillConnectorScheduler(link)
    scheduler.bind_worker(ranks)
    request = Request("r", PROMPT, PARAMS, publish_kv=True)
    request.status = RequestStatus.FINISHED_REMOTE_DECODE
    assert scheduler.request_finished(request, [0, 1, 2, 3, 4]) == (False, None)  # blocks freed now
    assert ranks.calls == [("publish", ("r", [0, 1, 2, 3], len(PROMPT))), ("abort", ("r",))]
    assert ranks.sending == [] and scheduler.stats() == {"kv_publish_failures": 1}
