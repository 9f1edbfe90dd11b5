"""Rank 0's side of tensor parallelism, in the engine core: spawns the workers, sends each one
command per step, gathers their replies, notices a dead worker, and stops them all on shutdown."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection, wait

import torch

from engine.parallel.commands import Call, ComputeLogits, Forward, Shutdown, WorkerInit
from engine.parallel.group import TPGroup, make_store, rank_device
from engine.parallel.layout import TPLayout

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a worker imports torch and loads its shard
STOP_TIMEOUT_S = 10.0


def threads_per_rank(config) -> int | None:
    """A CPU rank's torch threads: as configured, else the cores split over the ranks (N ranks
    each using every core would oversubscribe them)."""
    if config.parallel.num_threads:
        return config.parallel.num_threads
    return max(1, (os.cpu_count() or 1) // config.parallel.tensor_parallel_size)


class TPDriver:
    """The workers of ranks 1..N-1 and rank 0's end of the group."""

    def __init__(self, config, hf_config: dict, layout: TPLayout, device: torch.device, num_blocks: int,
                 kv_connector_factory=None) -> None:
        assert layout.rank == 0 and layout.size > 1
        self.size = layout.size
        for rank in range(layout.size):
            rank_device(device, rank)  # enough devices, before anything starts
        threads = threads_per_rank(config) if device.type == "cpu" else None
        # Process-wide: given back on shutdown (an LLM's process outlives its engine).
        self._threads_before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        # Stops the workers even if shutdown() is never called (an LLM dropped, the interpreter exiting).
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            self._start(config, hf_config, layout, device, num_blocks, threads, env, root, kv_connector_factory)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, config, hf_config, layout, device, num_blocks, threads, env, root, kv_connector_factory) -> None:
        store = make_store(0, layout.size)
        for rank in range(1, layout.size):
            ours, theirs = socket.socketpair()
            env["PDSERVE_TP_FD"] = str(theirs.fileno())
            self.procs.append(subprocess.Popen([sys.executable, "-m", "engine.parallel.worker"], env=env,
                                               pass_fds=(theirs.fileno(),), cwd=root))
            theirs.close()
            conn = Connection(ours.detach())
            self.conns.append(conn)
            conn.send(WorkerInit(rank, config, hf_config, store.port, num_blocks, threads, kv_connector_factory))
        self._expect("hello")  # imports done: a worker that cannot start fails here, not in a rendezvous
        self.group = TPGroup(layout, store, device)
        logger.info("tensor parallelism: %d ranks (workers' pids %s), %s", self.size,
                    [p.pid for p in self.procs], "nccl" if device.type == "cuda" else "gloo")

    def wait_ready(self) -> None:
        """Every worker has loaded its shard and allocated its KV cache."""
        self._expect("ready")

    def _expect(self, what: str) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            kind, payload = self._recv(rank, conn, START_TIMEOUT_S)
            if kind != what:
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start: {payload}")

    def _recv(self, rank: int, conn: Connection, timeout: float | None = None):
        if not wait([conn], timeout):
            raise RuntimeError(f"tensor-parallel worker rank {rank} did not answer within {timeout:.0f}s")
        try:
            return conn.recv()
        except (EOFError, OSError):
            raise self.worker_died(rank) from None

    def worker_died(self, rank: int) -> RuntimeError:
        proc = self.procs[rank - 1]
        try:
            code = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died"
                            + (f" (exit code {code})" if code is not None else "")
                            + ": the engine cannot run without every shard of the model")

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise self.worker_died(rank)

    def send(self, cmd) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(cmd)
            except OSError:
                raise self.worker_died(rank) from None

    def call(self, method: str, *args) -> list:
        """worker.<method>(*args) on every worker; their results, rank 1 first."""
        self.send(Call(method, args))
        return self.gather_replies()

    def gather_replies(self) -> list:
        """Every worker's reply (all read, so none is left for the next call), rank 1 first."""
        replies = [self._recv(rank, conn) for rank, conn in enumerate(self.conns, start=1)]
        for rank, (kind, payload) in enumerate(replies, start=1):
            if kind == "error":
                raise RuntimeError(f"tensor-parallel worker rank {rank}: {payload}")
        return [payload for _, payload in replies]

    def run(self, fn, *args):
        """fn(*args) on rank 0 while the workers run their half: a collective that fails because a
        worker died says so."""
        try:
            return fn(*args)
        except RuntimeError as e:
            for rank, proc in enumerate(self.procs, start=1):
                try:
                    proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    continue
                raise self.worker_died(rank) from e
            raise

    def shutdown(self) -> None:
        self._finalizer()
        self.group.close()
        torch.set_num_threads(self._threads_before)


def _stop(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(Shutdown())
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()


class TensorParallelModel:
    """Rank 0's shard behind the model's interface (forward, compute_logits, arch): each call
    first sends the workers their command, then runs rank 0's part of the collective work."""

    def __init__(self, local: torch.nn.Module, driver: TPDriver, draft: bool = False) -> None:
        """draft: the speculative draft's shards (each worker runs its own over its draft cache)."""
        self.local, self.driver, self.arch, self.draft = local, driver, local.arch, draft
        self.lora_batch: tuple | None = None  # set by TPLoRAManager.set_batch, sent with the next forward

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        self.driver.check_alive()
        on_host = input_ids.device.type == "cpu"
        cmd, packed = Forward.pack(input_ids, positions, meta, on_host, self.lora_batch, self.draft)
        self.lora_batch = None
        self.driver.send(cmd)
        if not on_host:
            self.driver.run(self.driver.group.broadcast, packed)
        return self.driver.run(self.local, input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.driver.send(ComputeLogits(hidden.shape[0], self.draft))
        hidden = hidden.contiguous()
        return self.driver.run(lambda: self.local.compute_logits(self.driver.group.broadcast(hidden)))
