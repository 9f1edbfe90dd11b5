"""Hand-made profiles for the simulator's tests: step costs known exactly."""
from __future__ import annotations

from services.planner.costmodel import StepCost, TransferCost
from services.planner.profile_data import ModelShape, Profile

SHAPE = ModelShape(num_layers=8, hidden_size=512, intermediate_size=1376, num_heads=8, num_kv_heads=4,
                   head_dim=64, vocab_size=4096, dtype_bytes=4)  # bench-pd's model: 64 KiB of KV a token

FLAT = StepCost(base=0.1, per_token=0.001, per_attn=0.0, per_kv_token=0.0, per_seq=0.0)
# Roughly bench-pd's CPU: ~1 s for a 1.5k-token prompt, ~20 ms decode steps.
CPU_LIKE = StepCost(base=0.012, per_token=4e-4, per_attn=2e-7, per_kv_token=2e-6, per_seq=5e-4)


def profile(step: StepCost, budget: int = 2048, max_seqs: int = 256, **kw) -> Profile:
    return Profile(step=step, transfers={"tcp": TransferCost(0.004, 1e9)}, model=SHAPE,
                   max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw)
