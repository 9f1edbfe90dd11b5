"""Exception types of the KV-transfer connector; each maps to one wire error code."""
from __future__ import annotations


class KVTransferError(Exception):
    """Base of every connector error; `code` names it on the wire."""
    code = "transfer_error"


class AuthError(KVTransferError):
    """A handle's tag, or a peer's handshake, does not verify with the deployment secret."""
    code = "auth"


class LayoutMismatch(KVTransferError):
    """The two sides' KV cache layouts (layers, heads, head dim, block size, dtype) differ."""
    code = "layout_mismatch"


class LeaseExpired(KVTransferError):
    """The prefill side no longer holds the blocks: the lease expired or was released."""
    code = "lease_expired"


class UnknownRequest(LeaseExpired):
    """No lease for that request id (never published, or already freed)."""
    code = "unknown_request"


class BlockRangeError(KVTransferError):
    """Block ids or counts outside what the handle or the local cache holds."""
    code = "block_range"


class TransferTimeout(KVTransferError):
    """The transfer did not finish before its deadline."""
    code = "timeout"


class TransferAborted(KVTransferError):
    """The request was aborted while its blocks were published or being pulled."""
    code = "aborted"


class PeerLost(KVTransferError):
    """The connection to the peer broke (closed, reset, truncated stream)."""
    code = "peer_lost"


class ProtocolError(KVTransferError):
    """A message that is malformed, oversized, or of an unknown version."""
    code = "protocol"


_BY_CODE = {cls.code: cls for cls in (
    KVTransferError, AuthError, LayoutMismatch, LeaseExpired, UnknownRequest, BlockRangeError,
    TransferTimeout, TransferAborted, PeerLost, ProtocolError)}


def error_from_code(code: str, message: str) -> KVTransferError:
    """Rebuild the exception a peer reported; unknown codes become the base type."""
    return _BY_CODE.get(code, KVTransferError)(message)
