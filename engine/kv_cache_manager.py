"""Per-request KV slots: prefix-cache lookup, allocation that returns None on shortage, free."""
from __future__ import annotations

from engine.block_hash import block_extra_keys, hash_request_tokens, lora_key
from engine.block_pool import BlockPool, KVCacheBlock
from engine.kv_events import BlockStored
from engine.request import Request


_NO_BLOCKS: list[int] = []  # shared, never mutated: "nothing new" on the fast path


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False, medium: str = "GPU",
                 lora_paths: dict[str, str] | None = None) -> None:
        self.block_size = block_size
        # adapter name -> path: part of its blocks' hashes (the engine's own map: adapters come and go)
        self.lora_paths = lora_paths if lora_paths is not None else {}
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events, medium)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already hashed
        self.prefix_queries = 0  # prompt tokens looked up / found, for the hit-rate metric
        self.prefix_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def update_block_hashes(self, request: Request) -> list[bytes]:
        """Extend request.block_hashes over every full block of its known tokens (engine.block_hash:
        the chained sha256 the router and outside indexers compute too)."""
        return hash_request_tokens(request.all_token_ids, self.block_size, request.sampling_params.cache_salt,
                                   request.block_hashes, self._lora_key(request))

    def _lora_key(self, request: Request) -> tuple | None:
        return lora_key(request.sampling_params.lora_name, self.lora_paths)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix; always leaves at least one token to compute (for logits)."""
        if not self.enable_caching or request.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        hashes = self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = (),
                       cache_now: bool = True) -> list[int] | None:
        """Make room for num_new_tokens past the computed ones; None if blocks run out.

        Returns the ids of newly allocated blocks (prefix hits included)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is not None and not new_computed_blocks:
            # Fast path (a decode step): room in the last block and no new full block to hash.
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * self.block_size and total // self.block_size <= self.num_cached_blocks[rid]:
                return _NO_BLOCKS
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
            self.req_to_block_ids[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_required = -(-total_tokens // self.block_size)
        num_new = num_required - len(blocks) - len(new_computed_blocks)
        if num_new <= 0 and not new_computed_blocks:
            if cache_now:
                self._cache_full_blocks(request, total_tokens)
            return []
        # Hits that sit in the free queue stop counting as free once we take them.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new > self.block_pool.num_free_blocks - num_revived:
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = list(new_computed_blocks)
        if num_new > 0:
            new_blocks += self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        new_ids = [b.block_id for b in new_blocks]
        self.req_to_block_ids[request.request_id].extend(new_ids)
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] += len(new_computed_blocks)
        if cache_now:
            self._cache_full_blocks(request, total_tokens)
        return new_ids

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks up to num_tokens to the prefix cache."""
        self._cache_full_blocks(request, num_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks[rid]
        if num_full <= start:
            return
        hashes = self.update_block_hashes(request)
        blocks = self.req_to_blocks[rid]
        num_full = min(num_full, len(hashes), len(blocks))
        stored = [i for i in range(start, num_full) if self.block_pool.cache_block(blocks[i], hashes[i])]
        self.num_cached_blocks[rid] = num_full
        if stored and self.block_pool.enable_kv_cache_events:
            self._report_stored(request, hashes, stored)

    def _report_stored(self, request: Request, hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks (a block that duplicated an
        already cached one breaks the run: its hash was reported when that one was stored)."""
        bs = self.block_size
        salt = request.sampling_params.cache_salt
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            lora = self._lora_key(request)
            extra = [block_extra_keys(i, salt, lora) for i in run]
            self.block_pool.kv_event_queue.append(BlockStored(
                block_hashes=hashes[first:end], parent_block_hash=hashes[first - 1] if first else None,
                token_ids=request.all_token_ids[first * bs:end * bs], block_size=bs, lora_id=None,
                lora_name=request.sampling_params.lora_name, medium=self.block_pool.medium,
                # untagged as vLLM publishes them: the bare adapter name, the bare salt
                extra_keys=[None if k is None else tuple(key[1] for key in k) for k in extra] if any(extra) else None))

    def take_events(self) -> list:
        """The KV events since the last call, in the order they happened."""
        return self.block_pool.take_events()

    def free_tail(self, request: Request, num_tokens: int) -> int | None:
        """Keep the blocks the first num_tokens need and free the rest (slots held for speculative
        tokens the verification rejected). Returns the number of blocks kept, None if none was freed."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return None
        # Only blocks full of verified tokens are hashed, and those are never past num_tokens.
        assert self.num_cached_blocks[rid] <= keep, f"request {rid}: freeing a cached block"
        tail = blocks[keep:]
        del blocks[keep:]
        del self.req_to_block_ids[rid][keep:]
        self.block_pool.free_blocks(reversed(tail))
        return keep

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_block_ids.get(request_id, [])

    def free(self, request: Request) -> None:
        """Return a request's blocks; tail first, so shared prefixes are evicted last."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def check_integrity(self, expect_all_free: bool = False) -> None:
        pool = self.block_pool
        pool.check_integrity(expect_all_free)
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), \
                f"{block}: ref count disagrees with the requests holding it ({refs.get(block.block_id, 0)})"
