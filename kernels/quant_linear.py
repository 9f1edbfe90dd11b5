"""Linear layers on weights kept as a quantized checkpoint stores them: FP8 e4m3 or INT8 (one
byte a weight: half a bfloat16 model's memory) or INT4 packed eight to an int32 (a quarter), each
output row scaled per group of input columns, with or without zero points:
`W[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]` (a group: the row for
per-tensor and per-channel scales, the block's width for block-scaled FP8, the group for W4A16).

On the Triton backend a fused kernel reads the stored tiles and dequantizes them next to the
matmul, so the full-precision weight is never in memory; elsewhere (the torch backends) each call
dequantizes the layer's weight and runs F.linear. Both round the dequantized weight to the
activations' dtype before the product, as the dequantize-at-load path and transformers do.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch path needs no triton
    triton = None
else:
    from kernels.triton_paged import dot_options

KINDS = ("fp8", "int8", "int4")
ACTIVATIONS = ("token", "tensor", "static")  # W8A8: the input's scales, per token or tensor, or the checkpoint's
FP8_MAX = 448.0
INT8_HALF_RANGE = 127.5  # compressed-tensors' symmetric INT8 scale: amax / (255 / 2)


def unpack_signed(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """[rows, ceil(columns * bits / 32)] int32 -> [rows, columns] float32 signed values
    (compressed-tensors' pack-quantized layout: 32 // bits to a word along the row, lowest bits
    first, each stored plus 2^(bits - 1))."""
    per = 32 // bits
    if packed.shape[-1] != -(-columns // per):
        raise ValueError(f"{packed.shape[-1]} int32 words a row do not hold {columns} {bits}-bit values "
                         "(another bit width than the config's?)")
    p = packed.to(torch.int64) & 0xFFFFFFFF
    values = torch.empty(packed.shape[0], packed.shape[1], per, dtype=torch.float32, device=packed.device)
    for k in range(per):
        values[..., k] = (p >> (bits * k)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)[:, :columns] - (1 << (bits - 1))


class QuantizedLinear(nn.Module):
    """A projection's stored weight, float32 scales [out, ceil(in / group)] and, when the
    checkpoint has them, int8 zero points of the same shape."""

    def __init__(self, in_features: int, out_features: int, kind: str, group: int, bias: bool,
                 use_triton: bool, has_zero: bool = False, activations: str | None = None,
                 input_scale: float | None = None, activation_ub: float | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kept weights are one of {', '.join(KINDS)}, not {kind!r}")
        if activations is not None and (kind not in ("fp8", "int8") or group != in_features
                                        or activations not in ACTIVATIONS
                                        or (activations == "static") != (input_scale is not None) or has_zero):
            raise ValueError(f"8-bit activations ({activations}, input scale {input_scale}) need FP8 or INT8 weights "
                             "scaled per channel or tensor, without zero points")
        # W8A8: the input quantized to the weights' 8 bits (FP8 or INT8) per token, per tensor or by
        # the checkpoint's static scale, and both 8-bit operands multiplied by torch._scaled_mm (FP8
        # tensor cores on a GPU) or torch._int_mm (INT8 ones; oneDNN's INT8 GEMM on the CPU).
        self.activations, self.input_scale, self.activation_ub = activations, input_scale, activation_ub
        # torch._scaled_mm wants dimensions in multiples of 16 (on a GPU); elsewhere, or if it
        # refuses the dtypes, the same quantized operands are multiplied dequantized.
        self._emulate = in_features % 16 != 0 or out_features % 16 != 0
        self.in_features, self.out_features = in_features, out_features
        self.kind, self.group, self.use_triton, self.has_zero = kind, group, use_triton, has_zero
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.qweight: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.rows_loaded = 0

    def allocate(self, device: torch.device) -> None:
        """The weight's storage, once the model is on its device (plain tensors: the model's
        dtype cast never touches them): int8 bytes (FP8 viewed through them) or int32 words."""
        if self.kind == "int4":
            self.qweight = torch.empty(self.out_features, -(-self.in_features // 8), dtype=torch.int32, device=device)
        else:
            self.qweight = torch.empty(self.out_features, self.in_features, dtype=torch.int8, device=device)
        groups = -(-self.in_features // self.group)
        self.scale = torch.empty(self.out_features, groups, dtype=torch.float32, device=device)
        if self.has_zero:
            self.zero = torch.zeros(self.out_features, groups, dtype=torch.int8, device=device)

    def load_rows(self, start: int, q: torch.Tensor, scale_rows: torch.Tensor, zero_rows: torch.Tensor | None) -> None:
        """One shard (q, k, v; gate, up; or the whole weight) at output row `start`."""
        rows = q.shape[0]
        want = self.qweight.shape[1]
        stored = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.int32}[self.kind]
        if q.dtype != stored or q.shape[1] != want or scale_rows.shape != (rows, self.scale.shape[1]) or (
                zero_rows is not None and (self.zero is None or zero_rows.shape != scale_rows.shape)):
            raise ValueError(f"a {tuple(q.shape)} {q.dtype} shard with scales {tuple(scale_rows.shape)} does not fit "
                             f"a kept {self.kind} weight of ({self.out_features}, {self.in_features}) in groups of "
                             f"{self.group}")
        at = slice(start, start + rows)
        self.qweight[at].copy_(q if self.kind == "int4" else q.view(torch.int8))
        self.scale[at].copy_(scale_rows)
        if zero_rows is not None:
            self.zero[at].copy_(zero_rows)
        self.rows_loaded += rows

    def values(self) -> torch.Tensor:
        """The stored values as float32 [out, in], less their zero points."""
        if self.kind == "int4":
            q = unpack_signed(self.qweight, 4, self.in_features)
        else:
            q = self.qweight.view(torch.float8_e4m3fn if self.kind == "fp8" else torch.int8).to(torch.float32)
        if self.zero is not None:
            q = q - self.zero.repeat_interleave(self.group, dim=1)[:, :self.in_features].to(torch.float32)
        return q

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (the torch path, and the reference)."""
        return reference.dequantize(self.values(), self.scale, self.group, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = self.w8a8(flat) if self.activations is not None else self.w8a16(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def w8a16(self, flat: torch.Tensor) -> torch.Tensor:
        """The input as it is times the weight dequantized (next to the dot on Triton)."""
        if not self.use_triton:
            return F.linear(flat, self.dequantized(flat.dtype), self.bias)
        stored = self.qweight.view(torch.float8_e4m3fn) if self.kind == "fp8" else self.qweight
        out = quantized_linear(flat, stored, self.kind, self.scale, self.zero, self.group, self.in_features)
        if self.bias is not None:
            out += self.bias
        return out

    def _input_scales(self, flat: torch.Tensor, top: float) -> torch.Tensor:
        """The input's float32 scales [rows, 1]: the checkpoint's static one, or amax / top per
        token or over the tensor (an all-zero row's the smallest float32 step; fbgemm's upper
        bound on a row's amax)."""
        m = flat.shape[0]
        if self.activations == "static":
            return torch.full((m, 1), self.input_scale, dtype=torch.float32, device=flat.device)
        amax = flat.abs().amax(dim=-1, keepdim=True) if self.activations == "token" else flat.abs().amax().expand(m, 1)
        amax = amax.to(torch.float32)
        if self.activation_ub is not None:
            amax = amax.clamp(max=self.activation_ub)
        scale_x = amax / top
        return torch.where(scale_x == 0, torch.finfo(torch.float32).eps, scale_x).contiguous()

    def w8a8(self, flat: torch.Tensor) -> torch.Tensor:
        """8-bit activations times the 8-bit weights, scaled per row of each. FP8: the input's
        scales amax / 448 (in float32, as vLLM; compressed-tensors' and vLLM's rule). INT8: amax /
        127.5, rounded to nearest even and clamped to [-128, 127] (compressed-tensors' rule, by
        which the checkpoint was calibrated; vLLM's kernel divides by 127)."""
        if self.kind == "int8":
            return self._w8a8_int8(flat)
        scale_x = self._input_scales(flat, FP8_MAX)
        xq = (flat.to(torch.float32) / scale_x).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        w = self.qweight.view(torch.float8_e4m3fn)
        out = None
        if not self._emulate:
            try:
                out = torch._scaled_mm(xq, w.t(), scale_a=scale_x, scale_b=self.scale.t().contiguous(),
                                       out_dtype=flat.dtype)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # e.g. a device or dtype without row-wise scaled FP8 matmuls
                self._emulate = True
                log.warning("torch._scaled_mm refused %s x %s FP8 operands to %s (%s): the FP8 activations are "
                            "dequantized and go through the 8-bit weight path instead (the same products, no FP8 "
                            "matmul)", tuple(xq.shape), tuple(w.shape), flat.dtype, str(e).splitlines()[0])
        if out is None:
            return self.w8a16((xq.to(torch.float32) * scale_x).to(flat.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out

    def _w8a8_int8(self, flat: torch.Tensor) -> torch.Tensor:
        """INT8 activations times INT8 weights: the products summed exactly in int32
        (torch._int_mm), then scaled by the input's row scale and the weight's row scale."""
        scale_x = self._input_scales(flat, INT8_HALF_RANGE)
        xq = torch.round(flat.to(torch.float32) / scale_x).clamp(-128, 127).to(torch.int8)
        out = None
        if not self._emulate:
            m = xq.shape[0]
            # cuBLASLt's INT8 GEMM takes more than 16 rows: a decode step's few are padded with zeros.
            rows = 17 if xq.is_cuda and m <= 16 else m
            a = xq if rows == m else torch.cat([xq, xq.new_zeros(rows - m, xq.shape[1])])
            try:
                acc = torch._int_mm(a, self.qweight.t())[:m]
                out = (acc.to(torch.float32) * scale_x * self.scale.t()).to(flat.dtype)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # a device or shape without an INT8 GEMM
                self._emulate = True
                log.warning("torch._int_mm refused %s x %s INT8 operands (%s): the INT8 activations are dequantized "
                            "and go through the 8-bit weight path instead (the same products, no INT8 matmul)",
                            tuple(xq.shape), tuple(self.qweight.shape), str(e).splitlines()[0])
        if out is None:
            return self.w8a16((xq.to(torch.float32) * scale_x).to(flat.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"group={self.group}, zero_points={self.has_zero}, activations={self.activations}, "
                f"bias={self.bias is not None}, "
                f"triton={self.use_triton}")


if triton is not None:
    @triton.jit
    def _quantized_linear_kernel(x, w, scale, zero, out, M, N, K, group, num_groups,
                                 stride_xm, stride_wn, stride_om,
                                 INT4: tl.constexpr, HAS_ZERO: tl.constexpr, TILE_SCALE: tl.constexpr,
                                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[m, n] = sum_k x[m, k] * round_to_x_dtype((q[n, k] - zero) * scale), accumulated in
        # float32: the dequantized tile is made next to the dot, never stored. TILE_SCALE: a group
        # spans whole K tiles, so a tile has one scale (and zero point) a row.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ty = x.dtype.element_ty
        row_n = rn[:, None].to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            wmask = (rn[:, None] < N) & (k[None, :] < K)
            if INT4:  # eight to an int32 word, lowest bits first, each stored plus 8
                word = tl.load(w + row_n * stride_wn + k[None, :] // 8, mask=wmask, other=0)
                q = (((word >> ((k[None, :] % 8) * 4)) & 0xF) - 8).to(tl.float32)
            else:
                q = tl.load(w + row_n * stride_wn + k[None, :], mask=wmask, other=0.0).to(tl.float32)
            if TILE_SCALE:
                at = row_n * num_groups + k0 // group
                s = tl.load(scale + at, mask=rn[:, None] < N, other=0.0)
                if HAS_ZERO:
                    q = q - tl.load(zero + at, mask=rn[:, None] < N, other=0).to(tl.float32)
            else:
                at = row_n * num_groups + k[None, :] // group
                s = tl.load(scale + at, mask=wmask, other=0.0)
                if HAS_ZERO:
                    q = q - tl.load(zero + at, mask=wmask, other=0).to(tl.float32)
            deq = (q * s).to(x_ty)
            if UPCAST:  # the interpreter's bf16 dot is wrong: the same rounded values, in float32
                acc += tl.dot(a.to(tl.float32), tl.trans(deq.to(tl.float32)), input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(a, tl.trans(deq), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, kind: str, scale: torch.Tensor,
                     zero: torch.Tensor | None, group: int, in_features: int) -> torch.Tensor:
    """x [M, K] @ dequantized(qweight).T -> [M, N] in x's dtype. qweight: [N, K] FP8 / INT8, or
    [N, ceil(K / 8)] int32 (INT4); scale float32 and zero int8 [N, ceil(K / group)]."""
    if triton is None:
        raise RuntimeError("the fused quantized linear needs triton")
    m, k = x.shape
    n = qweight.shape[0]
    groups = -(-k // group)
    if k != in_features or qweight.shape[1] != (-(-k // 8) if kind == "int4" else k) or \
            scale.shape != (n, groups) or scale.dtype != torch.float32 or \
            (zero is not None and (zero.shape != scale.shape or zero.dtype != torch.int8)):
        raise ValueError(f"x {tuple(x.shape)}, {kind} weight {tuple(qweight.shape)} and scale {tuple(scale.shape)} "
                         f"({scale.dtype}) do not fit groups of {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n = 32 if m <= 16 else 64  # a decode step's few rows: more programs over N
    block_k = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quantized_linear_kernel[grid](
        x, qweight, scale, zero if zero is not None else scale, out, m, n, k, group, groups,
        x.stride(0), qweight.stride(0), out.stride(0),
        INT4=kind == "int4", HAS_ZERO=zero is not None, TILE_SCALE=group % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot_options(x.dtype))
    return out


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """8-bit weights (FP8 or INT8, by qweight's dtype) without zero points."""
    kind = "fp8" if qweight.dtype == torch.float8_e4m3fn else "int8"
    return quantized_linear(x, qweight, kind, scale, None, group, x.shape[1])
