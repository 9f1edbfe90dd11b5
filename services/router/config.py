"""The router's frozen config, built once from the command line."""
from __future__ import annotations

from dataclasses import dataclass


def parse_addresses(value: str | list | tuple | None) -> tuple[str, ...]:
    """'h1:p1,h2:p2' (or a list of such strings) -> ('h1:p1', 'h2:p2'); checks each has a port."""
    if not value:
        return ()
    parts = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    out = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"instance address must be host:port, got {part!r}")
        if part not in out:
            out.append(part)
    return tuple(out)


@dataclass(frozen=True)
class RouterConfig:
    model: str  # checkpoint directory: the tokenizer, chat template and config.json come from it
    served_model_name: str
    decode: tuple[str, ...]
    prefill: tuple[str, ...] = ()  # empty: colocated mode (decode instances compute prompts)
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50050  # < 0: no gRPC front
    policy: str = "round_robin"
    api_key: str | None = None
    max_model_len: int | None = None  # None: what the instances report, else config.json
    request_timeout_s: float = 600.0
    prefill_timeout_s: float = 60.0
    max_attempts: int = 3
    health_check_interval_s: float = 2.0
    load_poll_interval_s: float = 0.5
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("at least one --decode instance is needed (decode-only = colocated mode)")
        if self.policy not in ("round_robin", "least_load"):
            raise ValueError(f"unknown routing policy {self.policy!r}; choose round_robin or least_load")
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be >= 1")
        for name in ("request_timeout_s", "prefill_timeout_s", "health_check_interval_s",
                     "load_poll_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)
