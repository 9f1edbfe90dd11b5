"""Rank 0's KV connector worker side under tensor parallelism: runs rank 0's connector and drives
every worker rank's, and reports a transfer only once every rank is done with it."""
from __future__ import annotations

from collections import Counter

from engine.kv_connector import KVConnectorMetadata, KVConnectorOutput, KVConnectorWorker


class RankTransfers:
    """Each rank reports its own end of a transfer; the scheduler hears of it once, when all have:

    - a load is finished once every rank finished it;
    - a load that failed on one rank is cancelled on the others (`to_cancel`) and reported failed
      once every rank stopped writing into its blocks (finished or failed there);
    - published blocks are sent (free to reuse) once every rank's lease ended.
    Pure bookkeeping (no I/O): the rules are tested with made-up per-rank outputs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._recving: dict[str, set[int]] = {}  # request id -> ranks that stopped writing
        self._failed: dict[str, str] = {}  # request id -> the first rank's reason
        self._sending: dict[str, set[int]] = {}  # request id -> ranks whose lease ended

    @property
    def outstanding(self) -> bool:
        return bool(self._recving or self._sending)

    def start_recving(self, request_id: str) -> None:
        self._recving.setdefault(request_id, set())

    def start_sending(self, request_id: str) -> None:
        self._sending.setdefault(request_id, set())

    def merge(self, outputs: list[KVConnectorOutput]) -> tuple[KVConnectorOutput, list[str]]:
        """outputs[r]: rank r's report since the last merge (an empty one for a rank not asked).
        -> (what the scheduler hears, loads to cancel on every rank now)."""
        assert len(outputs) == self.size
        merged, to_cancel = KVConnectorOutput(), []
        for rank, out in enumerate(outputs):
            for rid in out.finished_recving:
                if rid in self._recving:
                    self._recving[rid].add(rank)
            for rid, reason in out.failed_recving.items():
                if rid in self._recving:
                    self._recving[rid].add(rank)
                    if rid not in self._failed:
                        self._failed[rid] = f"rank {rank}: {reason}"
                        to_cancel.append(rid)
            for rid in out.finished_sending:
                if rid in self._sending:
                    self._sending[rid].add(rank)
        for rid, stopped in list(self._recving.items()):
            if len(stopped) < self.size:
                continue
            del self._recving[rid]
            reason = self._failed.pop(rid, None)
            if reason is None:
                merged.finished_recving.append(rid)
            else:
                merged.failed_recving[rid] = reason
        for rid, ended in list(self._sending.items()):
            if len(ended) == self.size:
                del self._sending[rid]
                merged.finished_sending.append(rid)
        # A load already stopped everywhere needs no cancel.
        return merged, [rid for rid in to_cancel if rid in self._recving]


class TPConnectorWorker(KVConnectorWorker):
    """Rank 0's connector (`local`) plus the workers' (each TPWorker builds its own from the same
    factory): metadata goes to every rank (one call per step, only when there is some), reports
    are gathered only while a transfer is outstanding (steps without P/D traffic pay nothing), and
    with them the workers' counters: stats() never calls the workers (it may come from another
    thread than the steps', and a worker's counters move only while a transfer is outstanding)."""

    def __init__(self, local: KVConnectorWorker, driver) -> None:
        self.local, self.driver = local, driver
        self.transfers = RankTransfers(driver.size)
        self._worker_stats: list[dict] = []

    def allocate_kv_caches(self, spec, num_blocks: int):
        return self.local.allocate_kv_caches(spec, num_blocks)  # the workers allocate their own

    def _on_workers(self, method: str, *args) -> list:
        return self.driver.call("kv_connector_call", method, args)

    def on_all_ranks(self, method: str, *args) -> list:
        return [getattr(self.local, method)(*args), *self._on_workers(method, *args)]

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for load in metadata.loads:
            self.transfers.start_recving(load.request_id)
        self.on_all_ranks("start_load_kv", metadata)

    def expect_sending(self, request_id: str) -> None:
        self.transfers.start_sending(request_id)

    def get_finished(self) -> KVConnectorOutput:
        outputs = [self.local.get_finished()]
        if self.transfers.outstanding:
            reports = self.driver.call("kv_connector_report")
            outputs += [output for output, _ in reports]
            self._worker_stats = [stats for _, stats in reports]
        else:  # nothing this engine waits for: stale reports (an aborted publish's) wait there
            outputs += [KVConnectorOutput() for _ in range(self.driver.size - 1)]
        merged, to_cancel = self.transfers.merge(outputs)
        if to_cancel:  # reported failed once every rank has stopped writing
            self.on_all_ranks("start_load_kv", KVConnectorMetadata(cancels=to_cancel))
        return merged

    def stats(self) -> dict[str, float]:
        """Every rank's counters summed (bytes moved, pulls, leases)."""
        total: Counter = Counter()
        for stats in [self.local.stats(), *self._worker_stats]:
            total.update({k: v for k, v in stats.items() if isinstance(v, (int, float))})
        return dict(total)

    def close(self) -> None:
        self.local.close()  # the workers close theirs as they stop
