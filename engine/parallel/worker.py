"""A tensor-parallel worker process (ranks 1..N-1): joins the group, loads its shard, allocates its
KV cache shard and runs the driver's commands until told to stop or the driver goes away.

Started by the driver as `python -m engine.parallel.worker` with one end of a socket pair
(PDSERVE_TP_FD): a plain subprocess, because the engine core process is daemonic and
multiprocessing forbids daemonic processes children."""
from __future__ import annotations

import logging
import os
import sys
from multiprocessing.connection import Connection

import torch

from engine.log_config import configure_logging
from engine.memory import module_bytes
from engine.parallel.commands import Call, ComputeLogits, Forward, Shutdown, WorkerInit

logger = logging.getLogger(__name__)


class TPWorker:
    """One rank's shard, KV cache shard and device group. Per-rank work beyond the forward pass
    (a KV connector's, say) is a method here, run on every worker by TPDriver.call(method, *args),
    which returns each worker's result."""

    def __init__(self, init: WorkerInit) -> None:
        from engine.device import resolve_device
        from engine.kv_connector import KVCacheSpec
        from engine.models import load_model
        from engine.models.llama import LlamaArch
        from engine.models.loader import resolve_dtype, resolve_kv_cache_dtype, resolve_max_model_len
        from engine.parallel.group import TPGroup, make_store, rank_device
        from engine.parallel.layout import TPLayout
        from kernels import get_backend

        config = init.config
        if init.num_threads:
            torch.set_num_threads(init.num_threads)
        arch = LlamaArch.from_hf_config(init.hf_config)
        self.layout = TPLayout.of(arch, config.parallel.tensor_parallel_size, init.rank)
        self.device = rank_device(resolve_device(config.parallel.device), init.rank)
        store = make_store(init.rank, self.layout.size, init.store_port)
        self.group = TPGroup(self.layout, store, self.device)
        self.dtype = resolve_dtype(config.model.dtype, init.hf_config)
        kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.kernels = get_backend(config.kernel_backend, self.device)
        max_model_len = resolve_max_model_len(init.hf_config, config.model.max_model_len)
        self.model = load_model(config.model.path, init.hf_config, self.kernels, self.dtype, self.device,
                                tp=self.group, linear_backend=config.model.linear_backend,
                                quantized_weights=config.model.quantized_weights,
                                max_model_len=max_model_len)
        self.num_blocks = init.num_blocks
        self.kv_connector = None
        if init.kv_connector_factory is not None:  # this rank's own connector (shm needs its caches)
            _, self.kv_connector = init.kv_connector_factory()
            spec = KVCacheSpec(arch.num_layers, self.layout.local_kv_heads, arch.head_dim, config.cache.block_size,
                               kv_dtype, self.device, self.layout.size, init.rank, arch.num_kv_heads)
            self.kv_caches = self.kv_connector.allocate_kv_caches(spec, init.num_blocks)
        else:
            shape = (2, init.num_blocks, config.cache.block_size, self.layout.local_kv_heads, arch.head_dim)
            self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=self.device)
                              for _ in range(arch.num_layers)]
        # A speculative draft split as the target is: this rank's shard and its share of the draft
        # cache, run when rank 0 runs its own (Forward / ComputeLogits with draft set).
        from engine.spec_decode.draft_model import DraftModel

        self.draft = DraftModel.of(config.speculative, arch, max_model_len, self.layout.size, init.rank)
        if self.draft is not None and self.draft.layout is not None:
            self.draft.load(self.kernels, self.dtype, self.device, config.model.linear_backend, group=self.group)
            self.draft.allocate(init.num_blocks, config.cache.block_size, kv_dtype, self.device)
        self.lora = None
        if config.lora is not None:  # this rank's shard of every adapter (--lora-modules' now)
            from engine.lora import LoRAManager

            self.lora = LoRAManager(config.lora, self.model, self.dtype, self.device, self.layout)

    @torch.inference_mode()
    def forward(self, cmd: Forward) -> None:
        if cmd.packed is not None:
            packed = torch.from_numpy(cmd.packed).to(self.device)
        else:
            packed = self.group.broadcast(torch.empty(cmd.size, dtype=torch.int64, device=self.device))
        input_ids, positions, meta = cmd.unpack(packed)
        if cmd.draft:
            self.draft.model(input_ids, positions, self.draft.kv_caches, meta)
            return
        if cmd.lora is not None:
            self.lora.set_batch(*cmd.lora)
        self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def compute_logits(self, cmd: ComputeLogits) -> None:
        model = self.draft.model if cmd.draft else self.model
        hidden = torch.empty((cmd.rows, model.arch.hidden_size), dtype=self.dtype, device=self.device)
        model.compute_logits(self.group.broadcast(hidden))

    def lora_call(self, method: str, args: tuple):
        """This rank's LoRAManager.<method>(*args) (add, remove, discard, stage, keep_host_copies),
        as rank 0 ran it. A failure is returned, not raised: (its exception's name, its message)."""
        try:
            return "ok", getattr(self.lora, method)(*args)
        except Exception as e:  # noqa: BLE001 (rank 0 raises it as its own kind)
            return type(e).__name__, str(e)

    def kv_connector_call(self, method: str, args: tuple):
        """This rank's KV connector worker side: method(*args) (see TPConnectorWorker)."""
        if self.kv_connector is None:
            raise RuntimeError(f"rank {self.layout.rank} has no KV connector")
        return getattr(self.kv_connector, method)(*args)

    def kv_connector_report(self) -> tuple:
        """This rank's transfers that ended since the last report, and its connector's counters."""
        return self.kv_connector.get_finished(), self.kv_connector.stats()

    def close(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.group.close()

    def info(self) -> dict:
        """What this rank holds (for the driver's checks and the tests)."""
        return {"rank": self.layout.rank, "pid": os.getpid(), "device": str(self.device),
                "num_blocks": self.num_blocks, "kv_cache_shape": tuple(self.kv_caches[0].shape),
                "kv_cache_dtype": str(self.kv_caches[0].dtype).removeprefix("torch."),
                "threads": torch.get_num_threads(), "weight_bytes": module_bytes(self.model),
                **({} if self.draft is None or not self.draft.kv_caches else
                   {"draft_kv_cache_shape": tuple(self.draft.kv_caches[0].shape)}),
                **({} if self.lora is None else {"lora_slots": dict(self.lora.slots),
                                                 "lora_host": sorted(self.lora.host)})}

    def serve(self, conn: Connection) -> None:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:  # the driver is gone
                return
            if isinstance(cmd, Forward):
                self.forward(cmd)
            elif isinstance(cmd, ComputeLogits):
                self.compute_logits(cmd)
            elif isinstance(cmd, Call):
                try:
                    reply = ("ok", getattr(self, cmd.method)(*cmd.args))
                except Exception as e:  # a call's failure is the caller's to report
                    reply = ("error", f"{type(e).__name__}: {e}")
                conn.send(reply)
            elif isinstance(cmd, Shutdown):
                return
            else:
                raise TypeError(f"unknown tensor-parallel command {cmd!r}")


def main() -> int:
    conn = Connection(int(os.environ["PDSERVE_TP_FD"]))
    init: WorkerInit = conn.recv()
    # The service that started this rank checked PDSERVE_LOG_LEVEL; the rank logs at the same level.
    configure_logging(f"%(asctime)s %(levelname)s tp-rank-{init.rank} %(name)s: %(message)s")
    conn.send(("hello", os.getpid()))
    try:
        worker = TPWorker(init)
    except Exception as e:
        logger.exception("tensor-parallel rank %d failed to start", init.rank)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready", None))
    try:
        worker.serve(conn)
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
