"""The KV connector seam, in the shape of vLLM v1's: a scheduler side and a worker side.

The engine does not import `kvtransfer` (layering: services wire it in). A service hands the
engine core a factory; inside the engine-core process it builds the two sides of one connector:

- the scheduler side is owned by the `Scheduler`: how many prompt tokens a request can load
  remotely, what was allocated for them, whether a finished request's blocks must outlive it
  (and the handle that lets another engine pull them); once a step it builds the metadata the
  worker side acts on;
- the worker side is owned by the `ModelRunner`: it allocates and registers the KV caches, starts
  the loads named in the metadata, and reports which transfers finished or failed.

One vocabulary from scheduler to transport: *recving* (this engine loads a request's KV),
*sending* (another engine reads a finished request's blocks here).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the scheduler side stays importable without torch
    import torch

    from engine.request import Request


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: "torch.dtype"
    device: "torch.device"
    # Tensor parallelism: this rank's shard holds num_kv_heads of the model's total_kv_heads.
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0  # 0: num_kv_heads (TP=1)


def zeroed_kv_caches(spec: KVCacheSpec, num_blocks: int) -> list["torch.Tensor"]:
    """The engine's own KV caches, one (2, num_blocks, block_size, kv_heads, head_dim) tensor per
    layer, zero-initialised: attention reads padding slots (masked), and 0 * NaN would poison them."""
    import torch

    return [torch.zeros((2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
                        dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]


@dataclass(frozen=True)
class KVLoad:
    """Pull the remote blocks [first_block, first_block + len(block_ids)) of `kv_handle` into
    the local `block_ids` (the first `first_block` blocks are already held here)."""
    request_id: str
    kv_handle: bytes
    block_ids: list[int]
    first_block: int


@dataclass
class KVConnectorMetadata:
    """Scheduler side -> worker side, once per step."""
    loads: list[KVLoad] = field(default_factory=list)
    # Stop transfers of these requests: a load in flight is cancelled, published blocks end
    # their lease. Either way the outcome comes back through `KVConnectorOutput`.
    cancels: list[str] = field(default_factory=list)
    # Keep the remote blocks of requests still waiting for room here: handle -> seconds.
    lease_extensions: list[tuple[bytes, float]] = field(default_factory=list)
    # Give the remote blocks back unread (every block was already cached here).
    releases: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.cancels or self.lease_extensions or self.releases)


@dataclass
class KVConnectorOutput:
    """Worker side -> scheduler, once per step: transfers that ended since the last one."""
    finished_recving: list[str] = field(default_factory=list)  # KV in place, blocks ready
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> reason
    finished_sending: list[str] = field(default_factory=list)  # held blocks may be freed

    def __bool__(self) -> bool:
        return bool(self.finished_recving or self.failed_recving or self.finished_sending)


class KVConnectorScheduler(ABC):
    """Scheduler-facing half. Never blocks on the network."""

    def add_request(self, request: "Request") -> None:
        """A request entered the scheduler (decode: check its handle, track its lease)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int | None:
        """Prompt tokens past the `num_computed_tokens` held locally that can be loaded from
        elsewhere; 0: compute them here; None: not yet known, ask again next step."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Blocks were allocated for the request: load the external tokens into them."""

    @abstractmethod
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, bytes | None]:
        """The request finished (its status says how). Returns (delay_free, kv_handle): delay_free
        keeps its blocks until a `finished_sending`/`*_recving` event names it; kv_handle is what
        another engine needs to pull them."""

    def cancel(self, request_id: str) -> None:
        """A finished request whose blocks are still held was aborted: end its transfers."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """What the worker side must do this step; resets the scheduler side's pending work."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker side's report, seen before the scheduler acts on it."""

    def bind_worker(self, worker: "KVConnectorWorker") -> None:
        """The worker side as the model runner drives it (under tensor parallelism, the driver's
        wrapper that reaches every rank), for work that must be answered at once (a publish)."""

    def stats(self) -> dict[str, float]:
        return {}


class KVConnectorWorker(ABC):
    """Model-runner-facing half: owns the transport."""

    @abstractmethod
    def allocate_kv_caches(self, spec: KVCacheSpec, num_blocks: int) -> list["torch.Tensor"]:
        """Allocate (zeroed) and register the engine's KV caches, one tensor per layer."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start what the metadata asks for; never blocks on the network."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers that ended since the last call; never blocks."""

    def stats(self) -> dict[str, float]:
        return {}

    def on_all_ranks(self, method: str, *args) -> list:
        """self.<method>(*args) on every rank of the engine (this one alone without tensor
        parallelism), rank 0's result first. The method reports failures in its result."""
        return [getattr(self, method)(*args)]

    def expect_sending(self, request_id: str) -> None:
        """The request's blocks were published on every rank: report it sent once every rank has."""

    def close(self) -> None:
        pass


# Builds both halves of one connector inside the engine-core process (it must be picklable to
# travel there: the services pass a frozen dataclass). Under tensor parallelism every worker rank
# calls it too and keeps the worker side, whose KVCacheSpec names the rank.
KVConnectorFactory = Callable[[], "tuple[KVConnectorScheduler, KVConnectorWorker]"]
