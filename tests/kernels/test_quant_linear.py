"""The fused quantized linear (FP8 e4m3 and INT8 weights, INT4 packed eight to an int32; scales
per output row and group of input columns, with or without zero points) against its torch
reference: dequantize the weight to the activations' dtype, then F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_cases import DTYPE_IDS, DTYPES, assert_close

FP8_MAX = 448.0
TOP = {"fp8": FP8_MAX, "int8": 127.0, "int4": 7.0}


def quantized(n: int, k: int, group: int, kind: str, zero_points: bool):
    """(stored weight, float32 scales, int8 zero points or None, the float32 values less zero points)."""
    w = torch.randn(n, k) * 0.05
    groups = -(-k // group)
    padded = torch.zeros(n, groups * group)
    padded[:, :k] = w
    scale = (padded.view(n, groups, group).abs().amax(dim=2) / TOP[kind]).clamp(min=1e-8)
    zero = torch.randint(-3, 4, (n, groups), dtype=torch.int8) if zero_points else None
    expand = lambda t: t.repeat_interleave(group, 1)[:, :k]  # noqa: E731
    q = w / expand(scale) + (expand(zero).float() if zero_points else 0)
    if kind == "fp8":
        q = q.to(torch.float8_e4m3fn)
        values = q.float()
        stored = q
    else:
        lo = -8 if kind == "int4" else -128
        q = torch.round(q).clamp(lo, -lo - 1)
        values = q.clone()
        if kind == "int4":
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            stored = pack_to_int32(q.to(torch.int8), 4)
        else:
            stored = q.to(torch.int8)
    if zero_points:
        values = values - expand(zero).float()
    return stored, scale, zero, values


def reference(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    w = values * scale.repeat_interleave(group, 1)[:, :values.shape[1]]
    return F.linear(x.float(), w.to(x.dtype).float()).to(x.dtype)


@pytest.mark.parametrize("kind, zero_points", [("fp8", False), ("int8", False), ("int8", True), ("int4", False),
                                               ("int4", True)], ids=["fp8", "int8", "int8-zero", "int4", "int4-zero"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m, n, k, group", [
    (1, 96, 200, 200),  # a decode row, per-channel scales; K and N not tile multiples
    (5, 130, 256, 128),  # 128-wide blocks (DeepSeek / Qwen3-FP8): one scale a tile and row
    (37, 64, 192, 32),  # a prefill chunk, W4A16's groups of 32: scales inside a tile
], ids=["decode-channel", "block-128", "prefill-group-32"])
def test_fused_quantized_linear_matches_dequantize_then_linear(device, kind, zero_points, dtype, m, n, k, group):
    from kernels.quant_linear import quantized_linear

    stored, scale, zero, values = quantized(n, k, group, kind, zero_points)
    x = torch.randn(m, k).to(dtype)
    got = quantized_linear(x.to(device), stored.to(device), kind, scale.to(device),
                           None if zero is None else zero.to(device), group, k)
    assert got.dtype == dtype and got.shape == (m, n)
    assert_close(got.cpu(), reference(x, values, scale, group), dtype)


def test_the_module_unpacks_as_the_kernel_reads(device):
    """QuantizedLinear's torch path (per call) and its Triton path agree with the reference."""
    from kernels.quant_linear import QuantizedLinear

    stored, scale, zero, values = quantized(48, 96, 32, "int4", True)
    x = torch.randn(3, 96)
    want = reference(x, values, scale, 32)
    for use_triton in (False, True):
        linear = QuantizedLinear(96, 48, "int4", 32, bias=False, use_triton=use_triton, has_zero=True)
        linear.allocate(torch.device(device))
        linear.load_rows(0, stored.to(device), scale.to(device), zero.to(device))
        assert_close(linear(x.to(device)).cpu(), want, torch.float32)


def test_bad_shapes_are_named(device):
    from kernels.quant_linear import w8a16_linear

    stored, scale, _, _ = quantized(32, 64, 32, "fp8", False)
    with pytest.raises(ValueError, match="do not fit groups of 16"):
        w8a16_linear(torch.randn(2, 64, device=device), stored.to(device), scale.to(device), 16)


@pytest.mark.parametrize("activations", ["token", "tensor", "static"])
def test_fp8_activations_scaled_mm_and_its_fallback_agree(activations):
    """W8A8: torch._scaled_mm on the FP8 operands, and the fallback for devices or dtypes it
    refuses (the same quantized operands dequantized), against the reference."""
    from kernels.quant_linear import FP8_MAX, QuantizedLinear

    stored, scale, _, values = quantized(48, 64, 64, "fp8", False)
    x = torch.randn(5, 64)
    input_scale = 4.0 / FP8_MAX if activations == "static" else None
    if activations == "static":
        scale_x = torch.full((5, 1), input_scale)
    else:
        amax = x.abs().amax(dim=-1, keepdim=True) if activations == "token" else x.abs().amax().expand(5, 1)
        scale_x = amax / FP8_MAX
    xq = (x / scale_x).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale_x
    want = reference(xq, values, scale, 64)
    for emulate in (False, True):
        linear = QuantizedLinear(64, 48, "fp8", 64, bias=False, use_triton=False, activations=activations,
                                 input_scale=input_scale)
        linear.allocate(torch.device("cpu"))
        linear.load_rows(0, stored, scale, None)
        linear._emulate = emulate
        assert_close(linear(x), want, torch.float32)
