"""HF-compatible model definitions and their safetensors loading."""
from engine.models.loader import SUPPORTED_ARCHITECTURES, load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "load_model"]
