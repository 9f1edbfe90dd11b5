"""The roles an engine service plays."""
from __future__ import annotations

import enum


class Role(str, enum.Enum):
    PREFILL = "prefill"  # computes prompts, publishes their KV for decode instances
    DECODE = "decode"  # pulls KV from prefill instances, continues with continuous batching
    COLOCATED = "colocated"  # a decode without a KV connector: computes prompts itself

    def __str__(self) -> str:
        return self.value

    @property
    def default_port(self) -> int:
        return {Role.PREFILL: 50051, Role.DECODE: 50061, Role.COLOCATED: 50071}[self]
