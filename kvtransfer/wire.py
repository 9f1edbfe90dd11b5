"""Control-plane wire format: a fixed 12-byte header, then one msgpack message; never pickle.

Header (network byte order): magic b"PDKV", protocol version (u8), reserved (3 bytes),
body length (u32). The body is a msgspec tagged union (`type` field). Bulk KV bytes never
travel inside a message: the tcp transport streams them raw right after `PullReady`.
"""
from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from typing import Annotated, Any, Union

import msgspec

from kvtransfer.errors import PeerLost, ProtocolError, TransferTimeout, error_from_code

MAGIC = b"PDKV"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("!4sB3xI")
MAX_MESSAGE_BYTES = 2 << 20  # bounds what a peer can make us allocate before anything is checked
_Bytes = Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES)]
_Str = Annotated[str, msgspec.Meta(max_length=256)]


class Hello(msgspec.Struct, tag="hello"):
    engine_id: _Str
    nonce: _Bytes


class Challenge(msgspec.Struct, tag="challenge"):
    engine_id: _Str
    nonce: _Bytes
    proof: _Bytes


class Auth(msgspec.Struct, tag="auth"):
    proof: _Bytes
    transport_info: dict[str, Any] = {}


class Welcome(msgspec.Struct, tag="welcome"):
    transport_info: dict[str, Any] = {}


class Pull(msgspec.Struct, tag="pull", omit_defaults=True):
    """Blocks [first_block, first_block + num_blocks) of the handle, global KV heads
    [head_start, head_end) of them (-1: the prefill rank's whole shard), for decode rank
    `decode_rank` of a TP=`decode_tp` engine; `layout` is the puller's KVLayout.describe()."""
    transfer_id: int
    handle: _Bytes
    first_block: int
    num_blocks: int
    layout_fingerprint: _Str
    timeout_s: float
    head_start: int = -1
    head_end: int = -1
    decode_rank: int = 0
    decode_tp: int = 1
    layout: _Str = ""


class PullReady(msgspec.Struct, tag="pull_ready"):
    transfer_id: int
    nbytes: int


class Finish(msgspec.Struct, tag="finish", omit_defaults=True):
    """One way, puller -> prefill, after its copy: unpins the blocks and (usually) releases them
    on behalf of decode rank `decode_rank` of `decode_tp` (the lease ends once all that need it have)."""
    transfer_id: int
    handle: _Bytes
    release: bool = True
    decode_rank: int = 0
    decode_tp: int = 1


class Extend(msgspec.Struct, tag="extend"):
    handle: _Bytes
    seconds: float


class Release(msgspec.Struct, tag="release", omit_defaults=True):
    handle: _Bytes
    decode_rank: int = 0
    decode_tp: int = 1


class Abort(msgspec.Struct, tag="abort"):
    handle: _Bytes


class Ok(msgspec.Struct, tag="ok"):
    lease_expiry: float = 0.0


class Error(msgspec.Struct, tag="error"):
    code: _Str
    message: Annotated[str, msgspec.Meta(max_length=4096)]


Message = Union[Hello, Challenge, Auth, Welcome, Pull, PullReady, Finish, Extend, Release, Abort, Ok, Error]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def handshake_key(secret: bytes, auth_token: bytes = b"") -> bytes:
    """The handshake's MAC key: the deployment secret, bound to the engines' token when there is one."""
    if not auth_token:
        return secret
    return hmac.new(secret, b"pdserve/kv-handshake-token/" + auth_token, hashlib.sha256).digest()


def proof(key: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """Handshake MAC: each side proves it holds the handshake key without sending it."""
    return hmac.new(key, b"pdserve/kv-handshake/" + role + client_nonce + server_nonce,
                    hashlib.sha256).digest()


def encode(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, len(body)) + body


def send_msg(sock: socket.socket, msg: Message, fds: list[int] | None = None) -> None:
    data = encode(msg)
    try:
        if fds:  # SCM_RIGHTS ride on the first byte; the rest follows as plain stream data
            socket.send_fds(sock, [data[:1]], fds)
            data = data[1:]
        sock.sendall(data)
    except socket.timeout:
        raise TransferTimeout("timed out sending a control message") from None
    except OSError as e:
        raise PeerLost(f"connection lost while sending: {e}") from None


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely or raise PeerLost (truncated stream) / TransferTimeout."""
    got, n = 0, len(view)
    try:
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise PeerLost(f"stream truncated: peer closed after {got} of {n} bytes")
            got += k
    except socket.timeout:
        raise TransferTimeout(f"timed out after {got} of {n} bytes") from None
    except ConnectionError as e:
        raise PeerLost(f"connection lost after {got} of {n} bytes: {e}") from None


def recv_msg(sock: socket.socket, max_fds: int = 0) -> tuple[Message, list[int]]:
    """Read one message (and any passed file descriptors); an `Error` message is raised."""
    header, fds = bytearray(HEADER.size), []
    view = memoryview(header)
    if max_fds:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1, max_fds)
        except OSError as e:
            raise PeerLost(f"connection lost: {e}") from None
        if not data:
            raise PeerLost("peer closed the connection")
        header[0:1] = data
        view = view[1:]
    recv_into_exact(sock, view)
    magic, version, length = HEADER.unpack(header)
    if magic != MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError(f"bad header: magic {magic!r}, version {version}")
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
    body = bytearray(length)
    recv_into_exact(sock, memoryview(body))
    try:
        msg = _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed message: {e}") from None
    if isinstance(msg, Error):
        raise error_from_code(msg.code, msg.message)
    return msg, fds


def expect(sock: socket.socket, kind: type, max_fds: int = 0) -> Any:
    msg, fds = recv_msg(sock, max_fds)
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
    return (msg, fds) if max_fds else msg
