"""What both roles' KV connectors share: the picklable config that builds them inside the engine-core
process, and the link from the scheduler side to the transport the worker side creates."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtransfer import KVHandle, KVLayout

from services.common.role import Role


@dataclass(frozen=True)
class KVConnectorConfig:
    """Sent to the engine-core process, which calls it to build (scheduler side, worker side)."""
    transport: str
    role: Role  # PREFILL or DECODE
    secret: bytes
    engine_id: str
    host: str = "127.0.0.1"  # prefill: where pulls connect
    port: int = 0  # prefill: 0 = any free port; else rank r of a tensor-parallel prefill serves port + r
    advertise_host: str | None = None  # prefill: the host handles name (default: host)
    lease_ttl_s: float = 30.0  # prefill: how long published KV stays pinned unpulled
    timeout_s: float = 30.0  # decode: deadline of one pull
    auth_token: bytes = field(default=b"", repr=False)  # the engines' token: KV control handshakes prove it too

    def __call__(self):
        link = TransportLink(self)
        if self.role is Role.PREFILL:
            from services.prefill.kv_connector import PrefillConnectorScheduler, PrefillConnectorWorker

            return PrefillConnectorScheduler(link), PrefillConnectorWorker(link)
        if self.role is Role.DECODE:
            from services.decode.kv_connector import DecodeConnectorScheduler, DecodeConnectorWorker

            return DecodeConnectorScheduler(link), DecodeConnectorWorker(link)
        raise ValueError(f"a {self.role} engine has no KV connector")


class TransportLink:
    """The kvtransfer connector both sides use. The worker side creates it when the model
    runner allocates the KV caches (the layout is known then), before any request arrives."""

    def __init__(self, config: KVConnectorConfig) -> None:
        self.config = config
        self._connector = None

    def create(self, spec, **kwargs):
        """The connector of the rank `spec` names: its shard's layout, its own engine id
        (f"{engine_id}-tp{rank}" under tensor parallelism: a merged handle names every rank)."""
        from kvtransfer import create_connector

        c = self.config
        layout = KVLayout.for_rank(spec.num_layers, spec.total_kv_heads or spec.num_kv_heads, spec.head_dim,
                                   spec.block_size, dtype=str(spec.dtype).removeprefix("torch."),
                                   device=str(spec.device), tp_size=spec.tp_size, tp_rank=spec.tp_rank)
        if layout.num_kv_heads != spec.num_kv_heads:
            raise ValueError(f"rank {spec.tp_rank} of {spec.tp_size} holds {spec.num_kv_heads} KV heads, "
                             f"its layout {layout.num_kv_heads}")
        engine_id = c.engine_id if spec.tp_size == 1 else f"{c.engine_id}-tp{spec.tp_rank}"
        self._connector = create_connector(c.transport, c.role.value, layout, secret=c.secret,
                                           engine_id=engine_id, auth_token=c.auth_token, **kwargs)
        return self._connector

    def port_of(self, spec) -> int:
        """Where this rank serves pulls: any free port, or the configured one plus the rank."""
        return self.config.port + spec.tp_rank if self.config.port else 0

    @property
    def connector(self):
        if self._connector is None:
            raise RuntimeError("the KV caches are not allocated yet")
        return self._connector

    @property
    def block_size(self) -> int:
        return self.connector.worker.layout.block_size

    def close(self) -> None:
        if self._connector is not None:
            self._connector.close()

    def parse_handle(self, data: bytes) -> KVHandle:
        """A handle this engine can pull with: well-formed, signed by the deployment, same model
        layout, from a prefill whose TP size this engine's can split the heads with."""
        from kvtransfer.shards import plan_pull

        handle = KVHandle.from_bytes(data)
        handle.verify(self.config.secret)
        layout = self.connector.worker.layout
        layout.check_compatible(handle.layout_fingerprint, handle.layout)
        plan_pull(layout, handle)  # every rank's plan stands or falls with rank 0's (one head split)
        return handle
