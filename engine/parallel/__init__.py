"""Tensor parallelism: one model sharded over N ranks (the engine core is rank 0, the driver)."""
from engine.parallel.layout import TPLayout, check_tensor_parallel_size

__all__ = ["TPLayout", "check_tensor_parallel_size"]
