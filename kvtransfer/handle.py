"""KVHandle: what a prefill instance hands out so that one decode instance can pull one request's blocks."""
from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Sequence

import msgspec

from kvtransfer.errors import AuthError, ProtocolError

HANDLE_VERSION = 1
MAX_HANDLE_BYTES = 1 << 20
MAX_BLOCKS = 1 << 18  # 4M tokens at block size 16: far beyond any context, small enough to bound memory
_SHORT = Annotated[str, msgspec.Meta(max_length=256)]
_TAG_DOMAIN = b"pdserve/kvhandle/v1"


class KVShardRef(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One tensor-parallel prefill rank's part of a handle: where it serves global KV heads
    [head_start, head_end) of the request's blocks, and the tag of its own lease (empty in the
    handle that rank publishes; `merge_shard_handles` fills it in)."""
    rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    endpoint: _SHORT
    head_start: Annotated[int, msgspec.Meta(ge=0)]
    head_end: Annotated[int, msgspec.Meta(ge=0)]
    engine_id: _SHORT
    tag: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class KVHandle(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request's published blocks on one prefill engine (all of its TP ranks).

    Wire format: a msgpack map of these fields (msgspec), versioned by `version`. `tag` is
    HMAC-SHA256, keyed by the deployment secret, over every other field. `shards` and `layout`
    are set only by tensor-parallel prefills and left out of the bytes (and of the tag) when
    empty, so a TP=1 handle is byte-for-byte what it was before they existed.
    """
    request_id: _SHORT
    engine_id: _SHORT
    transport: _SHORT
    endpoint: _SHORT
    block_ids: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)], ...], msgspec.Meta(max_length=MAX_BLOCKS)]
    num_tokens: Annotated[int, msgspec.Meta(ge=0)]
    layout_fingerprint: _SHORT
    lease_expiry: float
    tag: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    version: int = HANDLE_VERSION
    shards: Annotated[tuple[KVShardRef, ...], msgspec.Meta(max_length=1 << 10)] = ()
    layout: _SHORT = ""  # the prefill's KVLayout.describe(), for errors that name both sides

    def _signed_fields(self) -> bytes:
        fields: tuple = (_TAG_DOMAIN, self.version, self.request_id, self.engine_id, self.transport, self.endpoint,
                         self.block_ids, self.num_tokens, self.layout_fingerprint, self.lease_expiry)
        if self.shards or self.layout:
            fields += (self.shards, self.layout)
        return msgspec.msgpack.encode(fields)

    def signed(self, secret: bytes) -> "KVHandle":
        tag = hmac.new(secret, self._signed_fields(), hashlib.sha256).digest()
        return msgspec.structs.replace(self, tag=tag)

    def verify(self, secret: bytes) -> None:
        """Raise AuthError unless the tag was made with `secret` over exactly these fields."""
        expected = hmac.new(secret, self._signed_fields(), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, self.tag):
            raise AuthError(f"KV handle tag for request {self.request_id!r} does not verify")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def to_bytes(self) -> bytes:
        fields = msgspec.structs.asdict(self)
        for name in ("shards", "layout"):
            if not fields[name]:
                del fields[name]
        return msgspec.msgpack.encode(fields)

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVHandle":
        if len(data) > MAX_HANDLE_BYTES:
            raise ProtocolError(f"KV handle of {len(data)} bytes exceeds {MAX_HANDLE_BYTES}")
        try:
            handle = msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed KV handle: {e}") from None
        if handle.version != HANDLE_VERSION:
            raise ProtocolError(f"KV handle version {handle.version} is not {HANDLE_VERSION}")
        return handle


def merge_shard_handles(handles: Sequence[KVHandle], secret: bytes) -> KVHandle:
    """One handle for a request published on every rank of a tensor-parallel prefill: each rank's
    handle names its own shard; the merged one names them all (with each rank's lease tag) and is
    signed anew. Raises AuthError for a handle that does not verify, ProtocolError when the ranks
    disagree on the request, its blocks, tokens, layout or transport, or a rank is missing."""
    if not handles:
        raise ProtocolError("no shard handles to merge")
    for handle in handles:
        handle.verify(secret)
    if len(handles) == 1 and not handles[0].shards:
        return handles[0]  # TP=1: the handle is already whole
    first = handles[0]
    for handle in handles:
        if len(handle.shards) != 1 or handle.shards[0].tag:
            raise ProtocolError(f"handle of {handle.engine_id!r} for {handle.request_id!r} is not one rank's handle")
        for name in ("request_id", "transport", "block_ids", "num_tokens", "layout_fingerprint", "layout"):
            if getattr(handle, name) != getattr(first, name):
                raise ProtocolError(f"shard handles of {first.request_id!r} disagree on {name}: "
                                    f"{getattr(first, name)!r} (rank {first.shards[0].rank}) != "
                                    f"{getattr(handle, name)!r} (rank {handle.shards[0].rank})")
    refs = sorted((msgspec.structs.replace(h.shards[0], tag=h.tag) for h in handles), key=lambda ref: ref.rank)
    tp_size = refs[0].tp_size
    if [ref.rank for ref in refs] != list(range(tp_size)) or any(ref.tp_size != tp_size for ref in refs) \
            or len({ref.engine_id for ref in refs}) != tp_size:
        raise ProtocolError(f"request {first.request_id!r}: shard handles of ranks {[r.rank for r in refs]} "
                            f"do not make one TP={tp_size} prefill")
    return msgspec.structs.replace(first, engine_id=refs[0].engine_id, endpoint=refs[0].endpoint, shards=tuple(refs),
                                   lease_expiry=min(h.lease_expiry for h in handles), tag=b"").signed(secret)
