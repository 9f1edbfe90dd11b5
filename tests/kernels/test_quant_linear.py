"""The fused 8-bit linear (FP8 e4m3 and INT8 weights, scales per output row and group of input
columns) against its torch reference: dequantize the weight to the activations' dtype, then
F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_cases import assert_close

FP8_MAX = 448.0


def quantized(n: int, k: int, group: int, weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k) * 0.05
    groups = -(-k // group)
    padded = torch.zeros(n, groups * group)
    padded[:, :k] = w
    top = FP8_MAX if weight_dtype == torch.float8_e4m3fn else 127.0
    scale = (padded.view(n, groups, group).abs().amax(dim=2) / top).clamp(min=1e-8)
    q = w / scale.repeat_interleave(group, 1)[:, :k]
    q = q.to(weight_dtype) if weight_dtype == torch.float8_e4m3fn else torch.round(q).clamp(-127, 127).to(torch.int8)
    return q, scale


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    w = q.to(torch.float32) * scale.repeat_interleave(group, 1)[:, :q.shape[1]]
    return F.linear(x.float(), w.to(x.dtype).float()).to(x.dtype)


@pytest.mark.parametrize("weight_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m, n, k, group", [
    (1, 96, 200, 200),  # a decode row, per-channel scales; K and N not tile multiples
    (5, 130, 256, 128),  # 128-wide blocks (DeepSeek / Qwen3-FP8)
    (37, 64, 192, 64),  # a prefill chunk, groups of 64
], ids=["decode-channel", "block-128", "prefill-group-64"])
def test_fused_8bit_linear_matches_dequantize_then_linear(device, weight_dtype, dtype, m, n, k, group):
    from kernels.quant_linear import w8a16_linear

    q, scale = quantized(n, k, group, weight_dtype)
    x = torch.randn(m, k).to(dtype)
    got = w8a16_linear(x.to(device), q.to(device), scale.to(device), group)
    assert got.dtype == dtype and got.shape == (m, n)
    assert_close(got.cpu(), reference(x, q, scale, group), dtype)


def test_bad_shapes_are_named(device):
    from kernels.quant_linear import w8a16_linear

    q, scale = quantized(32, 64, 32, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="do not fit groups of 16"):
        w8a16_linear(torch.randn(2, 64, device=device), q.to(device), scale.to(device), 16)
