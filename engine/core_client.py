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
from typing import Callable

import msgspec

from engine.config import EngineConfig
from engine.request import Request, SamplingParams
from engine.scheduler import EngineCoreOutput

logger = logging.getLogger(__name__)
OutputCallback = Callable[[list[EngineCoreOutput]], None]


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    priority: int = 0

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params,
                       eos_token_id=self.eos_token_id, priority=self.priority)


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Ready(msgspec.Struct):
    max_model_len: int
    vocab_size: int
    num_blocks: int


_Inbound = AddRequest | Abort
_encoder = msgspec.msgpack.Encoder()


class _Loop:
    """The busy loop shared by both clients: drain inputs, step while there is work."""

    def __init__(self, core, get_input: Callable[[bool], object | None], emit: OutputCallback) -> None:
        self.core, self.get_input, self.emit = core, get_input, emit

    def run(self) -> None:
        while True:
            block = not self.core.has_unfinished_requests()
            msg = self.get_input(block)
            while msg is not None:
                if msg == "shutdown":
                    return
                self._handle(msg)
                msg = self.get_input(False)
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
                if outputs:
                    self.emit(outputs)

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self.core.add_request(msg.to_request())
        elif isinstance(msg, Abort):
            self.core.abort_requests(msg.request_ids)


class InprocClient:
    """Engine core in a background thread (torch releases the GIL in its kernels)."""

    def __init__(self, config: EngineConfig, on_output: OutputCallback) -> None:
        from engine.engine_core import EngineCore

        self.core = EngineCore(config)
        self.info = Ready(self.core.max_model_len, self.core.vocab_size, self.core.runner.num_blocks)
        self._inputs: queue.Queue = queue.Queue()
        loop = _Loop(self.core, self._get, on_output)
        self._thread = threading.Thread(target=loop.run, name="engine-core", daemon=True)
        self._thread.start()

    def _get(self, block: bool):
        try:
            return self._inputs.get(block=block)
        except queue.Empty:
            return None

    def send(self, msg) -> None:
        self._inputs.put(msg)

    def shutdown(self) -> None:
        self._inputs.put("shutdown")
        self._thread.join(timeout=10)


def _run_core_process(config: EngineConfig, in_addr: str, out_addr: str) -> None:
    import zmq

    from engine.engine_core import EngineCore

    ctx = zmq.Context()
    inbound = ctx.socket(zmq.PULL)
    inbound.connect(in_addr)
    outbound = ctx.socket(zmq.PUSH)
    outbound.connect(out_addr)
    decoder = msgspec.msgpack.Decoder(_Inbound)
    try:
        core = EngineCore(config)
    except Exception as e:  # report why we could not start, then exit
        outbound.send(_encoder.encode(("error", f"{type(e).__name__}: {e}")))
        return
    outbound.send(_encoder.encode(("ready", Ready(core.max_model_len, core.vocab_size,
                                                  core.runner.num_blocks))))

    def get(block: bool):
        if not block and not inbound.poll(0):
            return None
        frame = inbound.recv()
        return "shutdown" if frame == b"shutdown" else decoder.decode(frame)

    def emit(outputs):
        outbound.send(_encoder.encode(("outputs", outputs)))

    _Loop(core, get, emit).run()
    ctx.destroy(linger=0)


class MPClient:
    """Engine core in its own process: the front end's event loop never waits for a step."""

    def __init__(self, config: EngineConfig, on_output: OutputCallback, start_timeout: float = 300) -> None:
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
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=_run_core_process, args=(config, self.in_addr, self.out_addr),
                               name="pdserve-engine-core", daemon=True)
        self.proc.start()
        self._decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
        self._out_decoder = msgspec.msgpack.Decoder(list[EngineCoreOutput])
        self.info: Ready | None = None
        self._start_timeout = start_timeout
        self._task: asyncio.Task | None = None

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
        self._task = asyncio.get_running_loop().create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        while True:
            kind, payload = self._decoder.decode(await self.outbound.recv())
            if kind == "outputs":
                self.on_output(self._out_decoder.decode(payload))

    def send(self, msg) -> None:
        self.inbound.send(_encoder.encode(msg))

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.proc.is_alive():
            self.inbound.send(b"shutdown")
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
        self.inbound.close(linger=0)
        self.outbound.close(linger=0)
        self.ctx.term()
        self.actx.term()
        for addr in (self.in_addr, self.out_addr):
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except FileNotFoundError:
                pass
