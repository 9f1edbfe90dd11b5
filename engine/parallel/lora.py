"""LoRA adapters under tensor parallelism: every rank holds its shard of each adapter (each pair
split as its projection is, `LoRAAdapter.load(layout=...)`) in a LoRAManager of its own, and the
workers' managers do what rank 0's does, in the same order: adapters loaded, unloaded and staged
through calls, each step's rows by adapter sent with its forward. Slots, swaps and evictions are
decided alike on every rank (the same calls on the same state), so a slot holds one adapter on all."""
from __future__ import annotations

from engine import lora_errors
from engine.lora import LoRAManager


class TPLoRAManager:
    """Rank 0's LoRAManager (its state is the engine's: slots, host copies, counters) with every
    change made on the workers too. `model`: the TensorParallelModel the step's rows travel with."""

    def __init__(self, local: LoRAManager, model) -> None:
        self.local, self.model, self.driver = local, model, model.driver

    def __getattr__(self, name: str):  # slots, host, swaps, reloads, loaded, device_bytes, ...
        return getattr(self.local, name)

    def _on_workers(self, method: str, *args) -> list:
        """method(*args) on every worker's manager; their results, rank 1 first; the first failure
        raised as the exception the worker's manager raised (a LoRAAdapterError's kind kept)."""
        replies = self.driver.call("lora_call", method, args)
        for rank, (kind, payload) in enumerate(replies, start=1):
            if kind != "ok":
                cls = getattr(lora_errors, kind, None)
                if not (isinstance(cls, type) and issubclass(cls, Exception)):
                    cls = ValueError if kind == "ValueError" else RuntimeError
                raise cls(f"{payload} (tensor-parallel rank {rank})")
        return [payload for _, payload in replies]

    def add(self, name: str, path: str) -> None:
        """Loads the adapter on rank 0 (which checks it), then on every worker; a worker that
        cannot (no memory, its files changed meanwhile) leaves it loaded on none. (Under
        --max-cpu-loras rank 0's load may have evicted another's host copy: the workers drop
        theirs too, so every rank reads it back alike when it runs.)"""
        self.local.add(name, path)
        try:
            self._on_workers("add", name, path)
        except BaseException:
            self.local.remove(name)
            self.driver.call("lora_call", "discard", (name,))
            self.driver.call("lora_call", "keep_host_copies", (sorted(self.local.host),))
            raise

    def remove(self, name: str) -> None:
        self.local.remove(name)
        self._on_workers("remove", name)

    def stage(self, names: set[str], keep: set[str] = frozenset()) -> dict[str, str]:
        """LoRAManager.stage on every rank: the adapters any rank could not read back."""
        failed = dict(self.local.stage(names, keep))
        for theirs in self._on_workers("stage", names, keep):
            for name, why in theirs.items():
                failed.setdefault(name, why)
        return failed

    def set_batch(self, names: list[str | None], tokens_per_request, total_rows: int) -> None:
        self.local.set_batch(names, tokens_per_request, total_rows)
        self.model.lora_batch = (list(names), list(tokens_per_request), total_rows)
