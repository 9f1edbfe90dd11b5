"""KVHandle: what a prefill instance hands out so that one decode instance can pull one request's blocks."""
from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

import msgspec

from kvtransfer.errors import AuthError, ProtocolError

HANDLE_VERSION = 1
MAX_HANDLE_BYTES = 1 << 20
MAX_BLOCKS = 1 << 18  # 4M tokens at block size 16: far beyond any context, small enough to bound memory
_SHORT = Annotated[str, msgspec.Meta(max_length=256)]
_TAG_DOMAIN = b"pdserve/kvhandle/v1"


class KVHandle(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request's published blocks on one prefill engine.

    Wire format: a msgpack map of these fields (msgspec), versioned by `version`. `tag` is
    HMAC-SHA256, keyed by the deployment secret, over every other field.
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

    def _signed_fields(self) -> bytes:
        return msgspec.msgpack.encode((
            _TAG_DOMAIN, self.version, self.request_id, self.engine_id, self.transport, self.endpoint,
            self.block_ids, self.num_tokens, self.layout_fingerprint, self.lease_expiry))

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
        return msgspec.msgpack.encode(self)

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
