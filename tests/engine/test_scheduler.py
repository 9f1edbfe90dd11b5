"""The scheduler and block pool driven with fake model outputs: no torch, no model."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, SamplingParams
from engine.kv_connector import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, KVLoad
from engine.scheduler import ModelOutput, Scheduler

BS = 4


def make_scheduler(num_blocks=64, max_tokens=32, max_seqs=8, policy="fcfs", chunked=True, caching=True,
                   connector=None):
    kv = KVCacheManager(num_blocks, BS, caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                          enable_chunked_prefill=chunked, policy=policy)
    return Scheduler(cfg, kv, max_model_len=1024, connector=connector)


def req(rid, n_prompt, max_tokens=4, first=0, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True))
    return Request(rid, list(range(first, first + n_prompt)), params, eos_token_id=kw.pop("eos", None), **kw)


def fake_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    n_sample = sum(1 for r, n in zip(out.scheduled, out.num_scheduled_tokens)
                   if r.num_computed_tokens + n == r.num_tokens)
    return out, s.update_from_output(out, ModelOutput([token] * n_sample))


def run_to_end(s: Scheduler, limit=1000):
    finished = {}
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return finished
        _, results = fake_step(s)
        for r in results:
            if r.finish_reason:
                finished[r.request_id] = r.finish_reason
    raise AssertionError("scheduler did not drain")


def test_scheduler_imports_no_torch():
    code = ("import sys, engine.scheduler, engine.kv_cache_manager, engine.kv_connector; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_budget_and_chunked_prefill():
    s = make_scheduler(max_tokens=10)
    s.add_request(req("a", 25))
    out = s.schedule()
    assert out.num_scheduled_tokens == [10]
    s.update_from_output(out, ModelOutput([]))  # a chunk samples nothing
    assert s.requests["a"].num_computed_tokens == 10
    out, res = fake_step(s)
    assert out.num_scheduled_tokens == [10] and res == []
    out, res = fake_step(s)
    assert out.num_scheduled_tokens == [5] and res[0].new_token_ids == [7]
    out, res = fake_step(s)
    assert out.num_scheduled_tokens == [1]  # decode: one token
    s.kv.check_integrity()


def test_no_chunking_waits_for_budget():
    s = make_scheduler(max_tokens=10, chunked=False)
    s.add_request(req("big", 25))
    out = s.schedule()
    assert out.scheduled == []


def test_continuous_batching_admits_while_running():
    s = make_scheduler(max_tokens=64)
    s.add_request(req("a", 8, max_tokens=3))
    fake_step(s)
    s.add_request(req("b", 8, max_tokens=3, first=100))
    out, _ = fake_step(s)
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    assert out.num_scheduled_tokens == [1, 8]
    assert run_to_end(s) == {"a": "length", "b": "length"}
    s.kv.check_integrity(expect_all_free=True)


def test_max_num_seqs():
    s = make_scheduler(max_seqs=2, max_tokens=100)
    for i in range(4):
        s.add_request(req(f"r{i}", 4, first=10 * i))
    out = s.schedule()
    assert len(out.scheduled) == 2


def test_preemption_by_recompute_when_blocks_run_out():
    s = make_scheduler(num_blocks=6, max_tokens=64)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8, first=50))
    fake_step(s)  # both prompts: 2 blocks each, 2 free
    preempted = []
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        out, _ = fake_step(s)
        preempted += out.preempted_req_ids
        s.kv.check_integrity()
    assert preempted == ["b"], "the newest running request is the FCFS victim"
    assert not s.has_unfinished_requests()
    s.kv.check_integrity(expect_all_free=True)


def test_priority_policy_orders_and_preempts_by_priority():
    s = make_scheduler(num_blocks=6, max_tokens=64, policy="priority", max_seqs=1)
    s.add_request(req("low", 4, priority=5))
    s.add_request(req("high", 4, priority=0, first=20))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["high"]

    s = make_scheduler(num_blocks=5, max_tokens=64, policy="priority")
    s.add_request(req("high", 8, max_tokens=8, priority=0))
    s.add_request(req("low", 8, max_tokens=8, priority=9, first=40))
    preempted = []
    while s.has_unfinished_requests():
        out, _ = fake_step(s)
        preempted += out.preempted_req_ids
    assert preempted and set(preempted) == {"low"}
    s.kv.check_integrity(expect_all_free=True)


def test_stop_conditions():
    s = make_scheduler()
    s.add_request(req("eos", 4, max_tokens=10, eos=7, ignore_eos=False))
    s.add_request(Request("stopid", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7])))
    s.add_request(Request("mintok", [4, 5], SamplingParams(max_tokens=10, min_tokens=3), eos_token_id=7))
    assert run_to_end(s) == {"eos": "stop", "stopid": "stop", "mintok": "stop"}


def test_min_tokens_defers_eos():
    s = make_scheduler()
    s.add_request(Request("m", [4, 5], SamplingParams(max_tokens=10, min_tokens=3), eos_token_id=7))
    steps = 0
    while s.has_unfinished_requests():
        fake_step(s)
        steps += 1
    assert steps == 3


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler(max_tokens=64)
    s.add_request(req("a", 13, max_tokens=1))
    run_to_end(s)
    s.add_request(req("b", 13, max_tokens=1))
    out = s.schedule()
    # 13 tokens, block size 4: three full blocks are cached, the last token is recomputed.
    assert out.num_scheduled_tokens == [1]
    assert s.requests["b"].num_cached_tokens == 12
    s.update_from_output(out, ModelOutput([7]))
    s.kv.check_integrity(expect_all_free=True)


def test_abort_everywhere_frees_blocks():
    s = make_scheduler(max_seqs=1)
    s.add_request(req("run", 6, max_tokens=50))
    s.add_request(req("wait", 6, max_tokens=50, first=30))
    fake_step(s)
    s.finish_requests(["run", "wait", "unknown"])
    assert not s.has_unfinished_requests()
    s.kv.check_integrity(expect_all_free=True)


class FakeConnector(KVConnectorScheduler):
    """A scheduler-side connector that loads every remote prompt (or publishes every prefill)."""

    def __init__(self):
        self.allocated, self.finished, self.cancelled = {}, [], []
        self.meta = KVConnectorMetadata()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return request.num_prompt_tokens - num_computed_tokens if request.remote_kv else 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)
        self.meta.loads.append(KVLoad(request.request_id, request.remote_kv, list(block_ids), 0))

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, request.status))
        if request.status == RequestStatus.FINISHED_REMOTE_DECODE and request.publish_kv:
            return True, b"handle:" + request.request_id.encode()
        if request.request_id in self.allocated and request.status == RequestStatus.FINISHED_ABORTED:
            self.meta.cancels.append(request.request_id)
            return True, None  # aborted mid-load: held until the pull stops
        return False, None

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    def build_connector_meta(self):
        meta, self.meta = self.meta, KVConnectorMetadata()
        return meta


def kv_step(s: Scheduler, kv_out: KVConnectorOutput | None = None, token: int = 7):
    out = s.schedule()
    n_sample = sum(1 for r, n in zip(out.scheduled, out.num_scheduled_tokens)
                   if r.num_computed_tokens + n == r.num_tokens)
    return out, s.update_from_output(out, ModelOutput([token] * n_sample, kv_connector_output=kv_out))


def remote_req(rid, n_prompt, max_tokens=4, first=0):
    r = req(rid, n_prompt, max_tokens=max_tokens, first=first, remote_kv=b"h")
    r.append_token(99)  # the first token came from the prefill instance
    return r


def test_remote_kv_request_waits_then_joins_with_computed_tokens():
    conn = FakeConnector()
    s = make_scheduler(max_tokens=64, connector=conn)
    r = remote_req("remote", 10)
    s.add_request(r)
    out = s.schedule()
    assert out.scheduled == [] and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    (load,) = out.kv_connector_metadata.loads
    assert load.request_id == "remote" and len(load.block_ids) == 3
    assert conn.allocated["remote"] == (load.block_ids, 10)
    s.update_from_output(out, ModelOutput([]))
    kv_step(s)  # nothing to do while the KV is in flight
    kv_step(s, KVConnectorOutput(finished_recving=["remote"]))
    out, res = kv_step(s)
    assert out.num_scheduled_tokens == [1]  # only the first token's KV is computed here
    assert out.new_block_ids == [load.block_ids]  # the runner hears of the blocks once, all of them
    assert res[0].new_token_ids == [7]
    run_to_end(s)
    s.kv.check_integrity(expect_all_free=True)


def test_remote_kv_failure_recomputes_prompt():
    s = make_scheduler(max_tokens=64, connector=FakeConnector())
    s.add_request(remote_req("remote", 10, max_tokens=2))
    s.update_from_output(s.schedule(), ModelOutput([], kv_connector_output=KVConnectorOutput(
        failed_recving={"remote": "PeerLost: gone"})))
    out, _ = kv_step(s)
    assert out.num_scheduled_tokens == [11]
    run_to_end(s)
    s.kv.check_integrity(expect_all_free=True)


def test_requests_loading_remote_kv_count_against_max_num_seqs():
    s = make_scheduler(max_tokens=64, max_seqs=4, connector=FakeConnector())
    for i in range(12):
        s.add_request(remote_req(f"r{i}", 6, first=10 * i))
    out = s.schedule()
    assert len(out.kv_connector_metadata.loads) == 4 and s.num_seats_taken == 4
    s.update_from_output(out, ModelOutput([], kv_connector_output=KVConnectorOutput(
        finished_recving=[f"r{i}" for i in range(4)])))
    for _ in range(200):
        out, _ = kv_step(s, KVConnectorOutput(finished_recving=[
            load.request_id for load in (out.kv_connector_metadata.loads if out.kv_connector_metadata else [])]))
        assert len(out.scheduled) <= 4 and s.num_seats_taken <= 4
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests()
    s.kv.check_integrity(expect_all_free=True)


def test_abort_while_loading_holds_blocks_until_the_pull_stops():
    conn = FakeConnector()
    s = make_scheduler(max_tokens=64, connector=conn)
    s.add_request(remote_req("r", 10))
    s.update_from_output(s.schedule(), ModelOutput([]))
    s.finish_requests(["r"])
    out = s.schedule()
    assert out.kv_connector_metadata.cancels == ["r"] and s.has_pending_transfers()
    assert s.kv.block_pool.num_free_blocks < s.kv.block_pool.num_blocks  # the pull may still write
    s.update_from_output(out, ModelOutput([], kv_connector_output=KVConnectorOutput(
        failed_recving={"r": "TransferAborted"})))
    assert not s.has_pending_transfers()
    s.kv.check_integrity(expect_all_free=True)


@pytest.mark.parametrize("max_tokens,eos,stop_ids,expect", [
    (4, None, (), (RequestStatus.FINISHED_REMOTE_DECODE, None, True)),
    (1, None, (), (RequestStatus.FINISHED_LENGTH, "length", False)),
    (4, 7, (), (RequestStatus.FINISHED_STOPPED, "stop", False)),
    (4, None, (7,), (RequestStatus.FINISHED_STOPPED, "stop", False)),
])
def test_prefill_only_decides_stop_once_with_the_real_parameters(max_tokens, eos, stop_ids, expect):
    conn = FakeConnector()
    s = make_scheduler(connector=conn)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stop_ids)
    s.add_request(Request("p", list(range(9)), params, eos_token_id=eos, prefill_only=True, publish_kv=True))
    _, (result,) = kv_step(s, token=7)
    status, reason, published = expect
    assert conn.finished == [("p", status)] and result.finished
    assert result.finish_reason == reason and (result.kv_handle is not None) == published
    assert result.stop_reason == (7 if stop_ids else None)
    assert s.has_pending_transfers() == published
    s.finish_requests(["p"])  # an abort after the prefill: its transfer is cancelled
    assert conn.cancelled == (["p"] if published else [])
    s.update_from_output(s.schedule(), ModelOutput([], kv_connector_output=KVConnectorOutput(
        finished_sending=["p"])))
    s.kv.check_integrity(expect_all_free=True)


def test_new_block_ids_rebuild_every_block_table():
    """What the model runner is told adds up to the KV cache manager's own tables, through chunks,
    prefix hits, preemption and finishes."""
    s = make_scheduler(num_blocks=24, max_tokens=12, max_seqs=6)
    tables: dict[str, list[int]] = {}
    for i in range(8):
        s.add_request(req(f"r{i}", 5 + 3 * i, max_tokens=12, first=100 * (i % 3)))
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        out, _ = fake_step(s)
        for rid in [*out.finished_req_ids, *out.preempted_req_ids]:
            tables.pop(rid, None)
        for r, ids in zip(out.scheduled, out.new_block_ids):
            tables.setdefault(r.request_id, []).extend(ids)
            if not r.is_finished():  # a finished request's blocks are already freed
                assert tables[r.request_id] == s.kv.get_block_ids(r.request_id)
    assert not s.has_unfinished_requests() and s.num_preemptions > 0
    s.kv.check_integrity(expect_all_free=True)


def test_block_pool_lru_eviction_and_revival():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.free_blocks([b, a])  # b freed first: b is evicted first
    assert pool.num_free_blocks == 4
    pool.touch([pool.get_cached_block(111)])  # revive a out of the middle of the queue
    new = pool.get_new_blocks(3)
    assert a not in new and pool.get_cached_block(222) is None and pool.get_cached_block(111) is a
    pool.check_integrity()
    with pytest.raises(AssertionError):
        pool.free_blocks([new[0], new[0]])


def test_allocate_returns_none_on_shortage():
    kv = KVCacheManager(2, BS)
    r = req("x", 20)
    assert kv.allocate_slots(r, 20) is None
    kv.check_integrity(expect_all_free=True)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_adapters_to_run_cover_every_adapter_the_next_step_schedules(policy):
    """--max-cpu-loras stages `adapters_to_run()` in host memory before each step: whatever the
    queue's order (priority pops by priority, not by arrival), preemptions and the --max-loras cap
    passing requests over, each step's adapters are among them."""
    import random

    rng = random.Random(0)
    for _ in range(25):
        s = make_scheduler(num_blocks=12, max_tokens=24, max_seqs=4, policy=policy)
        s.max_loras = 2
        for i in range(14):
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 8), ignore_eos=True,
                                    lora_name=rng.choice([None, "a", "b", "c", "d"]))
            s.add_request(Request(f"r{i}", list(range(10 * i, 10 * i + rng.randint(2, 9))), params,
                                  priority=rng.randint(0, 5)))
        for _ in range(400):
            if not s.has_unfinished_requests():
                break
            staged = s.adapters_to_run()
            assert len(staged) <= 2
            out, _ = fake_step(s)
            assert {r.sampling_params.lora_name for r in out.scheduled} - {None} <= staged
        assert not s.has_unfinished_requests()
