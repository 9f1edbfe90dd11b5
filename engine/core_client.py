"""How a front end talks to its engine core: in a thread of this process, or in a process of
its own over ZMQ IPC with msgpack messages (never pickle), as vLLM V1 does."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import tempfile
import threading
import uuid
from collections import deque
from typing import Callable

import msgspec

from engine.config import EngineConfig
from engine.cpu_allocator import device_type_of, preload_for, preloading
from engine.log_config import configure_logging
from engine.request import Request, SamplingParams, generation_budget
from engine.scheduler import EngineCoreOutput

logger = logging.getLogger(__name__)
OutputCallback = Callable[[list[EngineCoreOutput]], None]


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    priority: int = 0
    prefill_only: bool = False  # prefill role: stop after the first token
    publish_kv: bool = False  # prefill role: and keep the prompt's KV for a decode's pull
    remote_kv: bytes | None = None  # decode role: KV handle of the prompt
    first_token_id: int | None = None  # decode role: sampled by the prefill instance

    def to_request(self) -> Request:
        request = Request(self.request_id, self.prompt_token_ids, self.sampling_params,
                          eos_token_id=self.eos_token_id, priority=self.priority,
                          remote_kv=self.remote_kv, prefill_only=self.prefill_only,
                          publish_kv=self.publish_kv)
        if self.first_token_id is not None:
            request.append_token(self.first_token_id)
        return request


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class LoadLoRA(msgspec.Struct, tag=True):
    """Load a LoRA adapter between steps; the core answers with a CallResult of the same call_id."""
    call_id: int
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag=True):
    call_id: int
    name: str


class CallResult(msgspec.Struct):
    """The core's answer to a LoadLoRA / UnloadLoRA: error is empty on success, else the
    LoRAAdapterError subclass's name (`error_type`) and its message."""
    call_id: int
    error_type: str = ""
    error: str = ""


class Ready(msgspec.Struct):
    max_model_len: int
    vocab_size: int
    num_blocks: int


_Inbound = AddRequest | Abort | LoadLoRA | UnloadLoRA
_encoder = msgspec.msgpack.Encoder()


class _Loop:
    """The busy loop shared by both clients: drain inputs, step while there is work.

    get_input(timeout): None = wait for a message, 0 = don't wait; returns None when none came.
    """

    STATS_INTERVAL_S = 0.05
    # An idle engine checks its tensor-parallel workers this often: a worker lost between
    # requests stops the engine now (its service exits, its supervisor restarts it) instead of
    # failing the next request. A step checks them anyway.
    LIVENESS_INTERVAL_S = 1.0

    def __init__(self, core, get_input: Callable[[float | None], object | None], emit: OutputCallback,
                 emit_result: Callable[[CallResult], None], emit_stats: Callable[[dict], None] | None = None) -> None:
        self.core, self.get_input, self.emit, self.emit_stats = core, get_input, emit, emit_stats
        self.emit_result = emit_result
        self.num_received = 0  # AddRequest messages taken in, in the order they were sent

    def stats(self) -> dict:
        return {**self.core.stats(), "requests_received": self.num_received}

    def run(self) -> None:
        import time

        last_stats = last_check = time.monotonic()
        try:
            while True:
                if self.core.has_unfinished_requests():
                    timeout = 0
                elif self.core.has_work() or self.emit_stats is not None:
                    timeout = 0.01  # pinned blocks: keep collecting transfer events
                else:
                    timeout = self.LIVENESS_INTERVAL_S
                msg = self.get_input(timeout)
                while msg is not None:
                    if msg == "shutdown":
                        return
                    self._handle(msg)
                    msg = self.get_input(0)
                if self.core.has_work():
                    outputs = self.core.step()
                    if outputs:
                        self.emit(outputs)
                now = time.monotonic()
                if self.emit_stats is not None and now - last_stats > self.STATS_INTERVAL_S:
                    last_stats = now
                    self.emit_stats(self.stats())
                if now - last_check >= self.LIVENESS_INTERVAL_S and not self.core.has_unfinished_requests():
                    last_check = now
                    self.core.check_alive()
        finally:
            self.core.shutdown()

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self.num_received += 1
            try:
                self.core.add_request(msg.to_request())
            except ValueError as e:  # validated in the front end; a last line of defence
                logger.error("rejected request %s: %s", msg.request_id, e)
                from engine.scheduler import EngineCoreOutput
                self.emit([EngineCoreOutput(msg.request_id, [], finish_reason="abort", stop_reason=str(e), finished=True)])
        elif isinstance(msg, Abort):
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
            try:
                if isinstance(msg, LoadLoRA):
                    self.core.add_lora(msg.name, msg.path)
                    logger.info("LoRA adapter %s loaded from %s", msg.name, msg.path)
                else:
                    self.core.remove_lora(msg.name)
            except Exception as e:  # a checkpoint that does not load is the caller's error, not the core's end
                from engine.lora_errors import LoRAAdapterError
                kind = type(e).__name__ if isinstance(e, LoRAAdapterError) else "LoRAAdapterError"
                self.emit_result(CallResult(msg.call_id, kind, str(e) if isinstance(e, (ValueError, OSError))
                                            else f"{type(e).__name__}: {e}"))
            else:
                self.emit_result(CallResult(msg.call_id))


def owed_tokens(msg: AddRequest) -> int:
    """The outstanding tokens the core counts for a request it has just added: its prompt (still
    to compute, or to load) plus the tokens it may generate (one for a prefill-only request)."""
    return len(msg.prompt_token_ids) + generation_budget(msg.sampling_params, msg.prefill_only)


class UnseenWork:
    """Requests sent to the core that its last stats do not show yet. The core reports its stats
    between steps, and a step may run for a second (a long prompt on a CPU): a load report that
    leaves out what was sent meanwhile shows a busy engine as idle to every router that polls it.
    Stats carry `requests_received`; what was sent after it is added to `outstanding_tokens`."""

    def __init__(self) -> None:
        self._num_sent = 0
        self._owed: deque[tuple[int, int]] = deque()  # (send number, tokens) not yet received
        self._lock = threading.Lock()  # a thread core's stats are read from the front end's thread

    def sent(self, msg) -> None:
        if isinstance(msg, AddRequest):
            with self._lock:
                self._num_sent += 1
                self._owed.append((self._num_sent, owed_tokens(msg)))

    def add_to(self, stats: dict) -> dict:
        """The core's stats, its outstanding tokens counting the requests it has not received."""
        if "requests_received" not in stats:
            return stats  # no stats yet
        with self._lock:
            while self._owed and self._owed[0][0] <= stats["requests_received"]:
                self._owed.popleft()
            owed = sum(tokens for _, tokens in self._owed)
        return {**stats, "outstanding_tokens": stats.get("outstanding_tokens", 0) + owed}


class InprocClient:
    """Engine core in a background thread (torch releases the GIL in its kernels)."""

    def __init__(self, config: EngineConfig, on_output: OutputCallback,
                 kv_connector_factory=None, on_death: Callable[[int | None], None] | None = None,
                 on_result: Callable[[CallResult], None] | None = None) -> None:
        from engine.engine_core import EngineCore

        self.core = EngineCore(config, kv_connector_factory=kv_connector_factory)
        self.info = Ready(self.core.max_model_len, self.core.vocab_size, self.core.runner.num_blocks)
        self._inputs: queue.Queue = queue.Queue()
        self._loop = _Loop(self.core, self._get, on_output, on_result or (lambda result: None))
        self._unseen = UnseenWork()
        self._on_death = on_death
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException:
            logger.exception("the engine core thread died")
            if self._on_death is not None:
                self._on_death(None)

    def _get(self, timeout: float | None):
        try:
            return self._inputs.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return None

    def stats(self) -> dict:
        # Read from another thread than the core's: a request taken in between the two reads is
        # counted twice for this report, never left out.
        received = self._loop.num_received
        return self._unseen.add_to({**self.core.stats(), "requests_received": received})

    def send(self, msg) -> None:
        self._unseen.sent(msg)
        self._inputs.put(msg)

    def shutdown(self) -> None:
        self._inputs.put("shutdown")
        self._thread.join(timeout=10)


def _die_with_parent() -> None:
    """The front end owns the engine core's life: it stops the core with a shutdown message, and
    on Linux the core gets SIGTERM if the front end is killed outright. A terminal's Ctrl-C reaches
    every process of its group: the core ignores it (no KeyboardInterrupt traceback while its
    front end drains) and leaves the decision to the front end."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _unlink_when_orphaned(*addrs: str) -> None:
    """SIGTERM reaches the core when its front end was killed outright (PR_SET_PDEATHSIG), whose
    shutdown, which unlinks the IPC sockets' files, then never runs: the core unlinks them, then
    dies of the signal as before (a crash no longer leaves pdserve-*-in/-out files in the temp dir)."""
    import signal

    paths = [a.removeprefix("ipc://") for a in addrs if a.startswith("ipc://")]

    def on_term(signum, frame):
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)


def _run_core_process(config: EngineConfig, in_addr: str, out_addr: str, kv_connector_factory) -> None:
    _die_with_parent()  # first: importing the engine takes seconds
    _unlink_when_orphaned(in_addr, out_addr)
    import zmq

    from engine.engine_core import EngineCore

    configure_logging()  # the front end checked PDSERVE_LOG_LEVEL before starting this process
    ctx = zmq.Context()
    inbound = ctx.socket(zmq.PULL)
    inbound.connect(in_addr)
    outbound = ctx.socket(zmq.PUSH)
    outbound.connect(out_addr)
    decoder = msgspec.msgpack.Decoder(_Inbound)
    try:
        core = EngineCore(config, kv_connector_factory=kv_connector_factory)
    except Exception as e:  # report why we could not start, then exit
        outbound.send(_encoder.encode(("error", f"{type(e).__name__}: {e}")))
        return
    outbound.send(_encoder.encode(("ready", Ready(core.max_model_len, core.vocab_size,
                                                  core.runner.num_blocks))))

    def get(timeout: float | None):
        if timeout is not None and not inbound.poll(int(timeout * 1000)):
            return None
        frame = inbound.recv()
        return "shutdown" if frame == b"shutdown" else decoder.decode(frame)

    def emit(outputs):
        outbound.send(_encoder.encode(("outputs", outputs)))

    def emit_stats(stats):
        outbound.send(_encoder.encode(("stats", stats)))

    def emit_result(result: CallResult):
        outbound.send(_encoder.encode(("result", result)))

    _Loop(core, get, emit, emit_result, emit_stats).run()
    ctx.destroy(linger=0)


class MPClient:
    """Engine core in its own process: the front end's event loop never waits for a step."""

    def __init__(self, config: EngineConfig, on_output: OutputCallback, kv_connector_factory=None,
                 start_timeout: float = 300, on_death: Callable[[int | None], None] | None = None,
                 on_result: Callable[[CallResult], None] | None = None) -> None:
        import zmq
        import zmq.asyncio

        base = os.path.join(tempfile.gettempdir(), f"pdserve-{uuid.uuid4().hex[:12]}")
        self.in_addr, self.out_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self.ctx = zmq.Context()
        self.actx = zmq.asyncio.Context()
        self.inbound = self.ctx.socket(zmq.PUSH)
        self.inbound.bind(self.in_addr)
        self.outbound = self.actx.socket(zmq.PULL)
        self.outbound.bind(self.out_addr)
        self.on_output = on_output
        self.on_result = on_result or (lambda result: None)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=_run_core_process, args=(config, self.in_addr, self.out_addr, kv_connector_factory),
                               name="pdserve-engine-core", daemon=True)
        # The core's allocator is its own (TCMalloc on the CPU where installed): it must be
        # preloaded when the process starts. Its tensor-parallel workers inherit it.
        device_type = device_type_of(config.parallel.device)
        with preloading(preload_for(config.parallel.cpu_allocator, device_type)):
            self.proc.start()
        self._decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
        self._out_decoder = msgspec.msgpack.Decoder(list[EngineCoreOutput])
        self.info: Ready | None = None
        self._stats: dict = {}
        self._unseen = UnseenWork()
        self._start_timeout = start_timeout
        self._task: asyncio.Task | None = None
        self.on_death = on_death
        self._watching = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout
        recv = asyncio.ensure_future(self.outbound.recv())
        while not recv.done():
            await asyncio.wait([recv], timeout=0.2)
            if not recv.done() and (not self.proc.is_alive() or loop.time() > deadline):
                recv.cancel()
                self.proc.kill()
                raise RuntimeError(f"engine core process exited during start-up "
                                   f"(exit code {self.proc.exitcode})" if self.proc.exitcode is not None
                                   else "engine core did not start in time")
        kind, payload = self._decoder.decode(recv.result())
        if kind == "error":
            raise RuntimeError(f"engine core failed to start: {msgspec.msgpack.decode(payload)}")
        self.info = msgspec.msgpack.decode(payload, type=Ready)
        self._task = loop.create_task(self._read_outputs())
        # The process's sentinel becomes readable when it exits: a dead core is noticed at once.
        loop.add_reader(self.proc.sentinel, self._core_exited)
        self._watching = True

    def _core_exited(self) -> None:
        self._stop_watching()
        self.proc.join(timeout=1)
        logger.error("engine core process exited unexpectedly (exit code %s)", self.proc.exitcode)
        if self.on_death is not None:
            self.on_death(self.proc.exitcode)

    def _stop_watching(self) -> None:
        if self._watching:
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
            self._watching = False

    async def _read_outputs(self) -> None:
        while True:
            kind, payload = self._decoder.decode(await self.outbound.recv())
            if kind == "outputs":
                self.on_output(self._out_decoder.decode(payload))
            elif kind == "stats":
                self._stats = msgspec.msgpack.decode(payload)
            elif kind == "result":
                self.on_result(msgspec.msgpack.decode(payload, type=CallResult))

    def stats(self) -> dict:
        return self._unseen.add_to(self._stats)

    def send(self, msg) -> None:
        self._unseen.sent(msg)
        self.inbound.send(_encoder.encode(msg))

    def stop_watching(self) -> None:
        """Before a deliberate shutdown: the core's exit is then no death. On the event loop."""
        self._stop_watching()

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.proc.is_alive():
            self.inbound.send(b"shutdown")
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
        # destroy, not term: term waits forever on any socket of the context still open, and a
        # core that died leaves the reader's socket mid-poll.
        self.inbound.close(linger=0)
        self.outbound.close(linger=0)
        self.ctx.destroy(linger=0)
        self.actx.destroy(linger=0)
        for addr in (self.in_addr, self.out_addr):
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except FileNotFoundError:
                pass
