"""Prefix-cache block hashes: sha256 over canonical CBOR, chained, the same as vLLM's `sha256_cbor`.

A block's hash is `sha256(cbor((parent_hash, token_ids, extra_keys)))` with the first block's
parent the fixed root `sha256(cbor("vllm-none-hash"))` and `extra_keys` either None or a tuple of
tagged keys: every block of a request with a LoRA adapter carries `("lora", name, path)`, and the
first block of a request with a `cache_salt` `("cache_salt", salt)` after it.
This is exactly vLLM's default (prefix_caching_hash_algo=sha256_cbor, PYTHONHASHSEED unset), so
the engines, the router's KV index and any outside indexer agree on a hash from token ids alone.
docs/routing.md has a golden vector. Pure Python, no torch: the router imports it too.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

BlockHash = bytes  # 32 bytes
NONE_HASH_SEED = "vllm-none-hash"


def _head(major: int, n: int) -> bytes:
    """A CBOR item head with the shortest length encoding (RFC 8949 canonical / deterministic)."""
    if n < 24:
        return bytes((major << 5 | n,))
    if n < 1 << 8:
        return bytes((major << 5 | 24, n))
    if n < 1 << 16:
        return bytes((major << 5 | 25,)) + struct.pack(">H", n)
    if n < 1 << 32:
        return bytes((major << 5 | 26,)) + struct.pack(">I", n)
    if n < 1 << 64:
        return bytes((major << 5 | 27,)) + struct.pack(">Q", n)
    raise ValueError(f"integer {n} does not fit CBOR's 64-bit heads")


def cbor_encode(value: object) -> bytes:
    """Canonical CBOR of None, bool, int, bytes, str and tuples/lists of them (what hashes use)."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: object, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        out += _head(0, value) if value >= 0 else _head(1, -1 - value)
    elif isinstance(value, (bytes, bytearray)):
        out += _head(2, len(value))
        out += value
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += _head(3, len(data))
        out += data
    elif isinstance(value, (tuple, list)):
        out += _head(4, len(value))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"cannot hash a {type(value).__name__} into a block hash")


def sha256_cbor(value: object) -> BlockHash:
    return hashlib.sha256(cbor_encode(value)).digest()


NONE_HASH: BlockHash = sha256_cbor(NONE_HASH_SEED)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """One full block's hash, chained on its parent's (None: the first block)."""
    return sha256_cbor((parent_hash or NONE_HASH, tuple(token_ids), extra_keys))


def lora_key(name: str | None, paths: dict[str, str]) -> tuple | None:
    """The prefix cache's extra key of a request's LoRA adapter (vLLM's ("lora", name, path), on
    every block: a name re-pointed at another adapter never reuses its KV)."""
    return ("lora", name, paths.get(name, "")) if name else None


def block_extra_keys(block_index: int, cache_salt: str | None, lora: tuple | None = None) -> tuple | None:
    """The extra keys of a request's block, as vLLM orders them: its LoRA adapter's on every block,
    then the cache salt on the first only (the chain carries it into every later block)."""
    keys = (lora,) if lora else ()
    if block_index == 0 and cache_salt:
        keys += (("cache_salt", cache_salt),)
    return keys or None


def hash_request_tokens(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                        parent_hashes: list[BlockHash] | None = None, lora: tuple | None = None) -> list[BlockHash]:
    """The hashes of every full block of `token_ids`, extending `parent_hashes` (already computed
    for its first blocks) in place when given. `lora`: the adapter's key (engine.lora.lora_key)."""
    hashes = parent_hashes if parent_hashes is not None else []
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                        block_extra_keys(i, cache_salt, lora)))
    return hashes
