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


def test_triton_backend_serves_a_mixture_of_experts_as_transformers(tiny_model_factory, triton_kernels):
    """Qwen2-MoE (routed experts and a shared one) on the fused MoE kernel: transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = tiny_model_factory("qwen2_moe", max_position_embeddings=256)
    prompts = [[3 + 7 * i for i in range(12)], [5, 9, 11, 42, 7]]
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    expected = [ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=4, min_new_tokens=4,
                             pad_token_id=ref.config.eos_token_id)[0, len(p):].tolist() for p in prompts]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model=model, kernel_backend="triton", dtype="float32", num_blocks=64, max_num_batched_tokens=7,
              device=device)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == expected
