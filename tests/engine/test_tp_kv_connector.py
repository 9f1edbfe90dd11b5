"""The TP driver's KV connector aggregation: the scheduler hears of a transfer once, when every rank is done."""
from __future__ import annotations

from engine.kv_connector import KVConnectorMetadata, KVConnectorOutput, KVConnectorWorker, KVLoad
from engine.parallel.kv_connector import RankTransfers, TPConnectorWorker

NONE = KVConnectorOutput()


def out(finished=(), failed=None, sent=()):
    return KVConnectorOutput(finished_recving=list(finished), failed_recving=dict(failed or {}),
                             finished_sending=list(sent))


def test_a_load_finishes_once_every_rank_finished_it():
    t = RankTransfers(3)
    t.start_recving("a")
    t.start_recving("b")
    merged, cancel = t.merge([out(finished=["a"]), out(finished=["a", "b"]), NONE])
    assert merged.finished_recving == [] and not merged.failed_recving and cancel == []
    merged, cancel = t.merge([out(finished=["b"]), NONE, out(finished=["a"])])
    assert merged.finished_recving == ["a"] and cancel == []
    assert t.outstanding  # b is still loading on rank 2
    merged, _ = t.merge([NONE, NONE, out(finished=["b"])])
    assert merged.finished_recving == ["b"] and not t.outstanding


def test_a_failure_on_one_rank_cancels_the_others_and_is_reported_once_they_stopped():
    t = RankTransfers(3)
    t.start_recving("a")
    merged, cancel = t.merge([NONE, out(failed={"a": "PeerGone: reset"}), NONE])
    assert cancel == ["a"]  # ranks 0 and 2 are still writing into its blocks
    assert not merged  # the blocks may not be reused yet
    merged, cancel = t.merge([out(failed={"a": "TransferAborted"}), NONE, NONE])
    assert not merged and cancel == []  # asked once only
    merged, cancel = t.merge([NONE, NONE, out(finished=["a"])])  # rank 2 had finished before the cancel
    assert merged.failed_recving == {"a": "rank 1: PeerGone: reset"} and merged.finished_recving == []
    assert not t.outstanding


def test_failures_on_every_rank_at_once_need_no_cancel():
    t = RankTransfers(2)
    t.start_recving("a")
    merged, cancel = t.merge([out(failed={"a": "x"}), out(failed={"a": "y"})])
    assert merged.failed_recving == {"a": "rank 0: x"} and cancel == []


def test_published_blocks_are_freed_once_every_rank_lease_ended():
    t = RankTransfers(2)
    t.start_sending("p")
    merged, _ = t.merge([out(sent=["p"]), NONE])
    assert merged.finished_sending == []
    merged, _ = t.merge([NONE, out(sent=["p"])])
    assert merged.finished_sending == ["p"] and not t.outstanding


def test_reports_of_transfers_nobody_waits_for_are_dropped():
    t = RankTransfers(2)  # e.g. a publish that failed on one rank, aborted on the other
    merged, cancel = t.merge([out(sent=["x"], finished=["y"]), out(failed={"z": "e"})])
    assert not merged and cancel == []


class FakeRank(KVConnectorWorker):
    """One rank's worker side: records what it was asked, reports what the test queues."""

    def __init__(self) -> None:
        self.metadata: list[KVConnectorMetadata] = []
        self.reports: list[KVConnectorOutput] = []
        self.asked = 0

    def allocate_kv_caches(self, spec, num_blocks):
        return []

    def start_load_kv(self, metadata):
        self.metadata.append(metadata)

    def get_finished(self):
        self.asked += 1
        return self.reports.pop(0) if self.reports else KVConnectorOutput()

    def stats(self):
        return {"bytes_received": 10, "pulls_finished": 1}


class FakeDriver:
    """TPDriver.call over in-process ranks (rank 1 first)."""

    def __init__(self, workers) -> None:
        self.workers, self.size, self.calls = workers, len(workers) + 1, 0

    def call(self, method, *args):
        self.calls += 1
        if method == "kv_connector_report":  # TPWorker.kv_connector_report
            return [(w.get_finished(), w.stats()) for w in self.workers]
        assert method == "kv_connector_call"
        name, call_args = args
        return [getattr(w, name)(*call_args) for w in self.workers]


def test_the_wrapper_asks_the_workers_only_while_transfers_are_outstanding():
    local, w1 = FakeRank(), FakeRank()
    driver = FakeDriver([w1])
    tp = TPConnectorWorker(local, driver)
    assert not tp.get_finished() and driver.calls == 0 and w1.asked == 0  # no P/D traffic: no round trip
    meta = KVConnectorMetadata(loads=[KVLoad("a", b"h", [3, 4], 0)])
    tp.start_load_kv(meta)
    assert local.metadata == [meta] and w1.metadata == [meta] and driver.calls == 1
    w1.reports.append(out(failed={"a": "LayoutMismatch"}))
    assert not tp.get_finished()  # rank 0 may still be writing: cancelled there
    assert local.metadata[-1].cancels == ["a"] and w1.metadata[-1].cancels == ["a"]
    local.reports.append(out(failed={"a": "TransferAborted"}))
    assert tp.get_finished().failed_recving == {"a": "rank 1: LayoutMismatch"}
    calls = driver.calls
    tp.get_finished()
    assert driver.calls == calls  # nothing outstanding again
    assert tp.stats() == {"bytes_received": 20, "pulls_finished": 2}  # summed over the ranks
    assert driver.calls == calls  # from the last report: stats() never calls the workers
