"""Linear layers on 8-bit weights kept as the checkpoint stores them (FP8 e4m3 or INT8, one byte
a weight: half a bfloat16 model's memory), each output row scaled per group of input columns:
`W[n, k] = q[n, k] * scale[n, k // group]` (a group: the row for per-tensor and per-channel
scales, the block's width for block-scaled FP8).

On the Triton backend a fused kernel reads the 8-bit tiles and dequantizes them next to the
matmul, so the full-precision weight is never in memory; elsewhere (the torch backends) each call
dequantizes the layer's weight and runs F.linear. Both round the dequantized weight to the
activations' dtype before the product, as the dequantize-at-load path and transformers do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch path needs no triton
    triton = None


class QuantizedLinear(nn.Module):
    """A projection's 8-bit weight [out, in] and float32 scales [out, ceil(in / group)]."""

    def __init__(self, in_features: int, out_features: int, weight_dtype: torch.dtype, group: int,
                 bias: bool, use_triton: bool) -> None:
        super().__init__()
        if weight_dtype not in (torch.float8_e4m3fn, torch.int8):
            raise ValueError(f"8-bit weights are float8_e4m3fn or int8, not {weight_dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.weight_dtype, self.group, self.use_triton = weight_dtype, group, use_triton
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.qweight: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.rows_loaded = 0

    def allocate(self, device: torch.device) -> None:
        """The weight's storage, once the model is on its device: int8 bytes (FP8 viewed through
        them), so the model's dtype cast never touches them, and float32 scales."""
        self.qweight = torch.empty(self.out_features, self.in_features, dtype=torch.int8, device=device)
        groups = -(-self.in_features // self.group)
        self.scale = torch.empty(self.out_features, groups, dtype=torch.float32, device=device)

    def load_rows(self, start: int, q: torch.Tensor, scale_rows: torch.Tensor) -> None:
        """One shard (q, k, v; gate, up; or the whole weight) at output row `start`."""
        if q.dtype != self.weight_dtype or q.shape[1] != self.in_features or scale_rows.shape != (
                q.shape[0], self.scale.shape[1]):
            raise ValueError(f"a {tuple(q.shape)} {q.dtype} shard with scales {tuple(scale_rows.shape)} does not fit "
                             f"an {self.weight_dtype} weight of ({self.out_features}, {self.in_features}) in "
                             f"groups of {self.group}")
        rows = slice(start, start + q.shape[0])
        self.qweight[rows].copy_(q.view(torch.int8))
        self.scale[rows].copy_(scale_rows)
        self.rows_loaded += q.shape[0]

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in `dtype` (the torch path, and the reference)."""
        q = self.qweight.view(self.weight_dtype).to(torch.float32)
        scale = self.scale.repeat_interleave(self.group, dim=1)[:, :self.in_features]
        return (q * scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.use_triton:
            out = w8a16_linear(flat, self.qweight.view(self.weight_dtype), self.scale, self.group)
            if self.bias is not None:
                out += self.bias
        else:
            out = F.linear(flat, self.weight(x.dtype), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight_dtype}, "
                f"group={self.group}, bias={self.bias is not None}, triton={self.use_triton}")


if triton is not None:
    @triton.jit
    def _w8a16_kernel(x, w, scale, out, M, N, K, group, num_groups,
                      stride_xm, stride_wn, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[m, n] = sum_k x[m, k] * round_to_x_dtype(q[n, k] * scale[n, k // group]), accumulated
        # in float32: the dequantized tile is made next to the dot, never stored.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ty = x.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            wmask = (rn[:, None] < N) & (k[None, :] < K)
            q = tl.load(w + rn[:, None].to(tl.int64) * stride_wn + k[None, :], mask=wmask, other=0.0)
            s = tl.load(scale + rn[:, None].to(tl.int64) * num_groups + k[None, :] // group, mask=wmask, other=0.0)
            deq = (q.to(tl.float32) * s).to(x_ty)
            acc += tl.dot(a, tl.trans(deq), out_dtype=tl.float32)
        tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] @ dequantized(qweight [N, K], scale [N, ceil(K / group)]).T -> [M, N] in x's dtype."""
    if triton is None:
        raise RuntimeError("the fused 8-bit linear needs triton")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k or scale.shape != (n, -(-k // group)) or scale.dtype != torch.float32:
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(qweight.shape)} and scale {tuple(scale.shape)} "
                         f"({scale.dtype}) do not fit groups of {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a16_kernel[grid](x, qweight, scale, out, m, n, k, group, scale.shape[1],
                        x.stride(0), qweight.stride(0), out.stride(0),
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
