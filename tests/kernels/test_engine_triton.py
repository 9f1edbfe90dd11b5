"""End to end: the engine on the Triton kernels (the interpreter on CPU) generates the reference's greedy tokens."""
from __future__ import annotations

import torch

from engine import LLM, SamplingParams


def test_triton_backend_generates_the_reference_tokens(tiny_model_factory, triton_kernels):
    model = tiny_model_factory("llama", max_position_embeddings=256)
    # Prompts of 12 and 5 tokens under a 7-token step budget: the first is prefilled in two
    # chunks (the second attends to the first's cache), step 3 mixes its first decode with the
    # rest of the other prompt, and the last steps are decode only.
    prompts = [[3 + 7 * i for i in range(12)], [5, 9, 11, 42, 7]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # The engine's device: a GPU when there is one (Triton's own kernels), else the CPU (its interpreter).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = {}
    for backend in ("reference", "triton"):
        llm = LLM(model=model, kernel_backend=backend, dtype="float32", num_blocks=64, max_num_batched_tokens=7,
                  device=device)
        assert llm.engine.runner.kernels.name == backend
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert all(len(t) == 4 for t in tokens["reference"])
    assert tokens["triton"] == tokens["reference"]
