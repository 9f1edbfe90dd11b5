"""KV cache layout descriptor: what two engines must agree on before blocks can move."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvtransfer.errors import LayoutMismatch

if TYPE_CHECKING:
    import torch

# Kept torch-free so that schedulers can import it; torch is imported only to build tensors.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class KVShard:
    """Which of the model's KV heads one tensor-parallel rank holds: global heads [head_start, head_end)."""
    tp_size: int
    tp_rank: int
    head_start: int
    head_end: int

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def shard_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV heads [start, end) of rank `tp_rank` of `tp_size`: contiguous equal slices, or,
    when there are fewer heads than ranks, one head per group of tp_size // total ranks (vLLM's
    replication). Raises ValueError for a split that is neither."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size} is not a rank")
    if total_kv_heads % tp_size == 0:
        local = total_kv_heads // tp_size
        return tp_rank * local, (tp_rank + 1) * local
    if tp_size % total_kv_heads == 0:
        head = tp_rank // (tp_size // total_kv_heads)
        return head, head + 1
    raise ValueError(f"{total_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks "
                     f"(neither divides the other)")


@dataclass(frozen=True)
class KVLayout:
    """Per layer the cache is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim].

    Under tensor parallelism the cache is rank `tp_rank`'s shard: `num_kv_heads` is the local
    count, `total_kv_heads` the model's (0: the same as num_kv_heads, i.e. no sharding)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"
    device: str = "cpu"
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.total_kv_heads == 0:
            if self.tp_size != 1:  # num_kv_heads * tp_size would be wrong when heads are replicated
                raise ValueError("a tensor-parallel layout must name total_kv_heads, the model's KV heads")
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        start, end = shard_heads(self.total_kv_heads, self.tp_size, self.tp_rank)
        if end - start != self.num_kv_heads:
            raise ValueError(f"rank {self.tp_rank} of {self.tp_size} holds {end - start} of the "
                             f"{self.total_kv_heads} KV heads, not num_kv_heads={self.num_kv_heads}")

    @classmethod
    def for_rank(cls, num_layers: int, total_kv_heads: int, head_dim: int, block_size: int, dtype: str = "float16",
                 device: str = "cpu", tp_size: int = 1, tp_rank: int = 0) -> "KVLayout":
        """The layout of rank `tp_rank`'s shard of a model's KV cache (num_kv_heads derived)."""
        start, end = shard_heads(total_kv_heads, tp_size, tp_rank)
        return cls(num_layers, end - start, head_dim, block_size, dtype, device, tp_size, tp_rank, total_kv_heads)

    @property
    def shard(self) -> KVShard:
        return KVShard(self.tp_size, self.tp_rank, *shard_heads(self.total_kv_heads, self.tp_size, self.tp_rank))

    def head_bytes_per_layer(self, num_heads: int) -> int:
        """Bytes of `num_heads` heads of one block in one layer, K and V together."""
        return 2 * self.block_size * num_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        """The model-level layout in words, for errors that must name both sides."""
        return (f"{self.num_layers} layers, {self.total_kv_heads} KV heads of dim {self.head_dim}, "
                f"block size {self.block_size}, {self.dtype}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block in one layer, K and V together."""
        return self.head_bytes_per_layer(self.num_kv_heads)

    @property
    def half_block_bytes(self) -> int:
        """Bytes of one block's K (or V) in one layer: the unit that is contiguous in memory."""
        return self.block_bytes_per_layer // 2

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers: what a transfer moves per block id."""
        return self.block_bytes_per_layer * self.num_layers

    @property
    def fingerprint(self) -> str:
        """Hash of everything that fixes the bytes of a block of the *model*; the device is
        deliberately left out (a CPU prefill may feed a GPU decode), so is num_blocks (each side
        sizes its own pool), and so is the sharding: engines of different TP sizes hold pieces of
        the same blocks (`shard` says which piece)."""
        desc = f"kv/v1/{self.num_layers}/{self.total_kv_heads}/{self.head_dim}/{self.block_size}/{self.dtype}"
        return hashlib.sha256(desc.encode()).hexdigest()[:16]

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @classmethod
    def from_kv_caches(cls, kv_caches: Sequence["torch.Tensor"]) -> "KVLayout":
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise LayoutMismatch(f"a KV cache layer must be [2, blocks, block_size, heads, head_dim], got {tuple(first.shape)}")
        layout = cls(len(kv_caches), first.shape[3], first.shape[4], first.shape[2],
                     str(first.dtype).removeprefix("torch."), str(first.device))
        layout.check_kv_caches(kv_caches)
        return layout

    def check_kv_caches(self, kv_caches: Sequence["torch.Tensor"]) -> int:
        """Validate caches against this layout; returns their common num_blocks."""
        if len(kv_caches) != self.num_layers:
            raise LayoutMismatch(f"expected {self.num_layers} layers, got {len(kv_caches)}")
        num_blocks = kv_caches[0].shape[1] if kv_caches[0].dim() == 5 else -1
        for i, cache in enumerate(kv_caches):
            if tuple(cache.shape) != self.cache_shape(num_blocks):
                raise LayoutMismatch(f"layer {i}: shape {tuple(cache.shape)} != {self.cache_shape(num_blocks)}")
            if cache.dtype != self.torch_dtype:
                raise LayoutMismatch(f"layer {i}: dtype {cache.dtype} != {self.dtype}")
            if not cache.is_contiguous():
                raise LayoutMismatch(f"layer {i}: the KV cache must be contiguous")
        return num_blocks

    def check_compatible(self, fingerprint: str, remote: str = "") -> None:
        """Raise LayoutMismatch unless `fingerprint` is this model's; `remote`, the peer's
        `describe()` when it sent one, goes into the message."""
        if fingerprint != self.fingerprint:
            theirs = f" ({remote})" if remote else ""
            raise LayoutMismatch(f"remote KV layout {fingerprint}{theirs} != local KV layout "
                                 f"{self.fingerprint} ({self.describe()})")
