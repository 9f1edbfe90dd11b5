"""Paged KV blocks: an O(1) LRU free queue, ref counts, and a hash -> block prefix cache."""
from __future__ import annotations

from typing import Iterable

from engine.kv_events import AllBlocksCleared, BlockRemoved


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # engine.block_hash (sha256), set once
        # Intrusive links of the free queue; None when the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head (LRU), remove from anywhere in O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)  # sentinels
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every KV block. Freed blocks keep their hash until they are reused (LRU eviction)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False,
                 medium: str = "GPU") -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # KV events (BlockStored / BlockRemoved / AllBlocksCleared) since the last take_events().
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self.kv_event_queue: list = []
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """n blocks with ref count 1, evicting the least recently freed cached blocks."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        evicted = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved(block_hashes=evicted, medium=self.medium))
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving blocks that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """True when the hash entered the prefix cache now (the caller reports it as stored)."""
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            assert block.block_hash == block_hash, "a block's hash is set once"
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this one stays anonymous
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the free queue in the given order
        (callers pass tail blocks first so they are evicted before shared prefixes)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())

    def take_events(self) -> list:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def check_integrity(self, expect_all_free: bool = False) -> None:
        """Loud invariants: free + used == total, ref counts, set-once hashes, cache index."""
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "free queue count drifted"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is in the free queue twice"
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(used) + len(free) == self.num_blocks, "free + used != total"
        assert all(b.ref_cnt == 0 for b in free), "a free block has references"
        assert not any(b.block_id in free_ids for b in used), "a used block is free"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, "prefix cache index points at a stale block"
        assert sum(b.block_hash is not None for b in self.blocks) == len(self.cached)
        if expect_all_free:
            assert not used, f"leaked blocks: {used[:8]}"
