"""Why a LoRA adapter cannot be loaded or unloaded at run time (no torch: the front ends import
them)."""
from __future__ import annotations


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
