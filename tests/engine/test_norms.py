"""The architectures' RMS norms against transformers' own modules: Gemma's (scaling by 1 + weight in
float32) and OLMo 2's (multiplying in float32 before rounding once) bit for bit, in bf16 too, where
their rounding points differ from Llama's (the kernels', which round the normalised x first)."""
from __future__ import annotations

import pytest
import torch

from engine.models.llama import Float32RMSNorm, LlamaArch, RMSNorm, make_norm
from kernels import get_backend

KERNELS = get_backend("torch")


def _hf_norm(kind: str, dim: int):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    return {"gemma": GemmaRMSNorm, "olmo2": Olmo2RMSNorm, "llama": LlamaRMSNorm}[kind](dim, eps=1e-6)


@pytest.mark.parametrize("kind", ["gemma", "olmo2", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_round_as_transformers(kind, dtype):
    torch.manual_seed(0)
    dim = 2304
    hf = _hf_norm(kind, dim).to(dtype)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.05)
    ours = {"gemma": Float32RMSNorm(dim, 1e-6, KERNELS, offset=1.0), "olmo2": Float32RMSNorm(dim, 1e-6, KERNELS),
            "llama": RMSNorm(dim, 1e-6, KERNELS)}[kind].to(dtype)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)  # the checkpoint's weight as stored (Gemma's is offset by 1 in the norm)
    x, residual = torch.randn(8, dim, dtype=dtype), torch.randn(8, dim, dtype=dtype)
    out, res = ours(x, residual)
    assert torch.equal(res, x + residual)
    if kind == "llama":  # the C++ kernel's vectorised sum of squares: float rounding, not bit for bit
        torch.testing.assert_close(out, hf(x + residual))
    else:  # torch ops in transformers' order: bit for bit
        assert torch.equal(out, hf(x + residual))


def test_each_architecture_takes_its_norm():
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4}
    for model_type, cls, offset in (("gemma2", Float32RMSNorm, 1.0), ("olmo2", Float32RMSNorm, 0.0),
                                    ("olmoe", RMSNorm, None), ("llama", RMSNorm, None)):
        norm = make_norm(LlamaArch.from_hf_config({**base, "model_type": model_type}), 64, KERNELS)
        assert type(norm) is cls and getattr(norm, "offset", None) == offset, model_type
