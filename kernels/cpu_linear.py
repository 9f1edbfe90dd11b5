"""Linear layers on the CPU through oneDNN, with each weight packed once at load.

`F.linear` on a plain row-major weight goes through MKL's sgemm every call; at the few rows of
a decode step that reads the weights at a third to a half of the bandwidth oneDNN reaches on
the same weights reordered once into its blocked layout (measured on a 2-core AMD EPYC, fp32:
a decode step's 33 matrices of bench-pd's model at 4 rows, 34 ms against 15 ms; at 512 rows of
prefill, 580 ms against 450). vLLM's CPU backend packs its weights for oneDNN for the same reason.

The packed weight replaces the module's own (no second copy), except where a weight is shared
(a tied lm_head keeps the embedding's and adds its packed copy). Results agree with `F.linear`
to float rounding (a different summation order), not bit for bit.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

LINEAR_BACKENDS = ("auto", "onednn", "torch")


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear in dtype."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    if probe is None:
        return False
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # an older torch without the probe: F.linear
        return False


class PackedLinear(nn.Module):
    """nn.Linear's forward on a oneDNN-packed weight (CPU only)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = in_features, out_features

    @classmethod
    def of(cls, linear: nn.Linear) -> "PackedLinear":
        w = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(packed, bias, linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _agrees(linear: nn.Linear, packed: PackedLinear) -> bool:
    """One small product through both: the packed layout is checked on this machine, at load."""
    w = linear.weight
    x = torch.randn(3, linear.in_features, dtype=w.dtype, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = nn.functional.linear(x, w, linear.bias).float()
        got = packed(x).float()
    tol = 1e-4 if w.dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * max(1.0, want.abs().max().item())))


def pack_linears(model: nn.Module, backend: str = "auto") -> int:
    """Swaps each nn.Linear of a CPU model for a PackedLinear; returns how many were packed.

    backend: "torch" leaves the model as it is; "onednn" packs or raises; "auto" packs where
    oneDNN supports the dtype (else leaves F.linear) and never on an accelerator.
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {', '.join(LINEAR_BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return 0
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears:
        return 0
    w = linears[0][1].weight
    if w.device.type != "cpu" or not onednn_supports(w.dtype):
        if backend == "onednn":
            raise ValueError(f"linear backend onednn needs CPU weights in a dtype oneDNN runs here, "
                             f"got {w.dtype} on {w.device}")
        return 0
    count = 0
    for name, linear in linears:
        packed = PackedLinear.of(linear)
        if count == 0 and not _agrees(linear, packed):  # every layer shares the path: check one
            if backend == "onednn":
                raise RuntimeError("oneDNN's packed linear disagrees with F.linear on this machine")
            log.warning("oneDNN's packed linear disagrees with F.linear here: keeping F.linear")
            return 0
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, packed)
        count += 1
    return count
