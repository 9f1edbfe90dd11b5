"""The pdserve engine core shared by the prefill and decode services.

Imports are lazy so that the pure-Python parts (scheduler, block pool) load without torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncEngine": "engine.async_engine",
    "SamplingParams": "engine.request",
    "InvalidRequestError": "engine.request",
    "LoRARequest": "engine.lora_errors",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
