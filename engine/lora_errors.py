"""LoRA adapters named at run time, and why one cannot be loaded or unloaded (no torch: the front
ends import these)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest(lora_name, lora_int_id, lora_path): the offline API's way to run prompts
    with an adapter, loaded on first use. The id is vLLM's; here the name identifies the adapter."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name or not self.lora_path:
            raise ValueError("LoRARequest needs a lora_name and a lora_path")


class LoRAAdapterError(ValueError):
    """A runtime load or unload that cannot be done; the subclasses say why (each its own status)."""


class LoRANotEnabledError(LoRAAdapterError):
    """The engine serves no adapters (no --enable-lora)."""


class LoRAAdapterExistsError(LoRAAdapterError):
    """An adapter of that name is loaded already."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No adapter of that name is loaded."""


class LoRAAdapterBusyError(LoRAAdapterError):
    """The name's previous adapter is unloaded but still finishing requests."""


class LoRAOutOfMemoryError(LoRAAdapterError):
    """The device has no memory left for the adapter's weights."""
