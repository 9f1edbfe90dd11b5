"""Block hashes: vLLM's sha256_cbor chain (golden vectors), the same in every process, and
cache_salt isolating tenants in the prefix cache."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.block_hash import NONE_HASH, cbor_encode, hash_block_tokens, hash_request_tokens, sha256_cbor
from engine.kv_cache_manager import KVCacheManager
from engine.request import InvalidRequestError, Request, SamplingParams

# Computed with vLLM's own kv_cache_utils.hash_block_tokens(sha256_cbor, ...) after
# init_none_hash(sha256_cbor), PYTHONHASHSEED unset; docs/routing.md lists the same vectors.
GOLDEN = {
    "block0 = tokens 0..15": "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
    "block1 = tokens 16..31 after block0": "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
    "block0 with cache_salt 'tenant-a'": "4e31e1ced73eb044a95997f0109d0ddab3d9145878214f1a0ee37c048b397859",
    "large token ids": "8fc428f49d812983bdde954a058c4c3d4e990e36f5c36dc0404f7a47322de4a9",
}
BIG = [0, 23, 24, 255, 256, 65535, 65536, 151643, 2 ** 32]


def _computed() -> dict[str, str]:
    b0 = hash_block_tokens(None, range(16))
    return {
        "block0 = tokens 0..15": b0.hex(),
        "block1 = tokens 16..31 after block0": hash_block_tokens(b0, range(16, 32)).hex(),
        "block0 with cache_salt 'tenant-a'": hash_block_tokens(None, range(16), (("cache_salt", "tenant-a"),)).hex(),
        "large token ids": hash_block_tokens(None, BIG).hex(),
    }


def test_golden_vectors_match_vllm_sha256_cbor():
    assert _computed() == GOLDEN
    assert NONE_HASH == sha256_cbor("vllm-none-hash")


def test_canonical_cbor_heads():
    # RFC 8949 examples: shortest-form heads.
    assert cbor_encode(0) == bytes.fromhex("00")
    assert cbor_encode(23) == bytes.fromhex("17")
    assert cbor_encode(24) == bytes.fromhex("1818")
    assert cbor_encode(1000) == bytes.fromhex("1903e8")
    assert cbor_encode(1000000) == bytes.fromhex("1a000f4240")
    assert cbor_encode(-1) == bytes.fromhex("20")
    assert cbor_encode("a") == bytes.fromhex("6161")
    assert cbor_encode(b"\x01") == bytes.fromhex("4101")
    assert cbor_encode((1, (2, 3))) == bytes.fromhex("8201820203")
    assert cbor_encode(None) == bytes.fromhex("f6")
    with pytest.raises(TypeError):
        cbor_encode(1.5)


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_hashes_are_stable_across_processes(seed):
    """Another interpreter (another PYTHONHASHSEED) computes the same chain."""
    code = ("import json; from engine.block_hash import hash_request_tokens as h; "
            "print(json.dumps([x.hex() for x in h(list(range(1000, 1100)), 16, 'salt')]))")
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    import json

    assert json.loads(out.stdout) == [x.hex() for x in hash_request_tokens(list(range(1000, 1100)), 16, "salt")]


def test_chain_and_salt_semantics():
    tokens = list(range(40))
    plain = hash_request_tokens(tokens, 16)
    assert len(plain) == 2  # full blocks only
    salted = hash_request_tokens(tokens, 16, "t1")
    assert all(a != b for a, b in zip(plain, salted))  # the salt reaches every block through the chain
    assert hash_request_tokens(tokens, 16, "t1") == salted
    assert hash_request_tokens(tokens, 16, "t2")[1] != salted[1]
    # A shared prefix shares hashes; a different first block changes every later hash.
    assert hash_request_tokens(tokens[:16] + [7] * 16, 16)[0] == plain[0]
    assert hash_request_tokens([1] + tokens[1:], 16)[1] != plain[1]
    # Extending an existing list computes only the new blocks.
    partial = hash_request_tokens(tokens[:20], 16)
    assert hash_request_tokens(tokens, 16, parent_hashes=partial) is partial and partial == plain


def _request(rid: str, prompt: list[int], salt: str | None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, cache_salt=salt))


def _cache_prompt(kv: KVCacheManager, request: Request) -> None:
    assert kv.allocate_slots(request, request.num_tokens) is not None
    kv.free(request)


@pytest.mark.parametrize("first,second,hit_tokens", [
    (None, None, 32), ("tenant-a", "tenant-a", 32), ("tenant-a", "tenant-b", 0),
    ("tenant-a", None, 0), (None, "tenant-a", 0)])
def test_cache_salt_isolates_tenants_in_the_prefix_cache(first, second, hit_tokens):
    kv = KVCacheManager(num_blocks=16, block_size=16)
    prompt = list(range(100, 140))
    _cache_prompt(kv, _request("a", prompt, first))
    hits, num = kv.get_computed_blocks(_request("b", prompt, second))
    assert num == hit_tokens and len(hits) == hit_tokens // 16
    kv.check_integrity(expect_all_free=True)


def test_engine_block_hashes_equal_the_router_side_function():
    kv = KVCacheManager(num_blocks=16, block_size=16)
    request = _request("a", list(range(50)), "s")
    assert kv.update_block_hashes(request) == hash_request_tokens(list(range(50)), 16, "s")
    _cache_prompt(kv, request)
    assert set(kv.block_pool.cached) == set(hash_request_tokens(list(range(50)), 16, "s"))


def test_empty_cache_salt_is_refused():
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="")
