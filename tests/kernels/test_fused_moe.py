"""The mixture-of-experts MLP: the torch backend's grouped loop and the Triton kernel against the
reference (transformers' expert loop), and the tile layout the kernel runs on."""
from __future__ import annotations

import unittest.mock as mock

import pytest
import torch

from kernel_cases import DTYPE_IDS, DTYPES, assert_close
from kernels import moe, reference


def route(t: int, experts: int, k: int, hidden: int, dtype: torch.dtype, skew: bool = False):
    """Random tokens routed as a model routes them: top-k of a softmax, renormalised."""
    x = torch.randn(t, hidden, dtype=dtype)
    logits = torch.randn(t, experts)
    if skew:  # most tokens to expert 1, none to the last two: empty and crowded experts
        logits[:, 1] += 4.0
        logits[:, -2:] -= 100.0
    weights, ids = torch.topk(torch.softmax(logits, -1), k, -1)
    return x, weights / weights.sum(-1, keepdim=True), ids


def experts_weights(experts: int, inter: int, hidden: int, dtype: torch.dtype):
    return (torch.randn(experts, 2 * inter, hidden, dtype=dtype) * hidden ** -0.5,
            torch.randn(experts, hidden, inter, dtype=dtype) * inter ** -0.5)


def test_reference_is_the_dense_sum_over_each_tokens_experts():
    x, weights, ids = route(5, 4, 2, 16, torch.float64)
    w13, w2 = experts_weights(4, 8, 16, torch.float64)
    out = reference.fused_moe(x, w13, w2, weights, ids)
    for t in range(5):
        want = sum(weights[t, j] * (w2[e] @ (torch.nn.functional.silu(w13[e, :8] @ x[t]) * (w13[e, 8:] @ x[t])))
                   for j, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(out[t], want)


@pytest.fixture
def without_cpu_extension(monkeypatch):
    """The torch backend as it runs where the C++ extension cannot be built."""
    from kernels import cpu_ops

    monkeypatch.setenv("PDSERVE_NO_CPU_EXTENSION", "1")
    cpu_ops.load.cache_clear()
    yield
    cpu_ops.load.cache_clear()


@pytest.mark.parametrize("t", [1, 7, 64, 300])
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
def test_torch_backend_without_the_extension_matches_the_reference(t, skew, monkeypatch, without_cpu_extension):
    """Per-expert matmuls (few experts hit, a crowded one, or many rows an expert): the reference
    to the bit. Every expert hit evenly (a decode batch): one padded batched matmul, within float
    rounding, and only then."""
    x, weights, ids = route(t, 8, 2, 32, torch.float32, skew)
    w13, w2 = experts_weights(8, 24, 32, torch.float32)
    padded = []
    real = moe._padded
    monkeypatch.setattr(moe, "_padded", lambda *a: padded.append(1) or real(*a))
    out, want = moe.fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids)
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    assert bool(padded) == (bool((counts > 0).all()) and 8 * int(counts.max()) <= 2 * ids.numel()
                            and int(counts.max()) <= 128)
    if padded:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(out, want)
    if t == 64 and not skew:
        assert padded, "64 tokens spread over 8 experts run batched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bf16", "fp16"])
@pytest.mark.parametrize("t,skew", [(1, False), (7, False), (64, False), (300, True), (600, True)])
def test_cpu_extension_matches_the_reference(t, skew, dtype, monkeypatch):
    """The C++ path (experts in parallel over two threads) while no expert has 128 rows, under
    inference mode with the weights as parameters, as the engine calls it; an expert of 128 rows
    or more (600 tokens, skewed) runs as per-expert matmuls instead."""
    from kernels import cpu_ops

    real = cpu_ops.load()
    assert real is not None, "the C++ extension should build here (gcc is installed)"
    x, weights, ids = route(t, 8, 2, 32, dtype, skew)
    w13, w2 = (torch.nn.Parameter(w) for w in experts_weights(8, 24, 32, dtype))
    calls = []

    class Spy:
        def fused_moe(self, *a):
            calls.append(1)
            return real.fused_moe(*a)

    monkeypatch.setattr(cpu_ops, "load", lambda: Spy())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            want = reference.fused_moe(x, w13, w2, weights, ids)
            out = moe.fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.set_num_threads(threads)
    most = int(torch.bincount(ids.reshape(-1), minlength=8).max())
    assert bool(calls) == (most < 128) and (t < 300 or not calls)
    assert_close(out, want, dtype)


def test_cpu_extension_is_not_used_under_autograd(monkeypatch):
    """Gradients through a mixture (a user's fine-tuning loop): the torch path, which autograd follows."""
    from kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "load", lambda: pytest.fail("the C++ path has no autograd"))
    x, weights, ids = route(5, 8, 2, 32, torch.float32)
    w13, w2 = (torch.nn.Parameter(w) for w in experts_weights(8, 24, 32, torch.float32))
    moe.fused_moe(x, w13, w2, weights, ids).sum().backward()
    assert w13.grad is not None and w13.grad.abs().sum() > 0


@pytest.mark.parametrize("t,experts,k,block_m", [(1, 8, 2, 16), (37, 6, 3, 16), (50, 4, 1, 64), (3, 64, 8, 16)])
def test_align_by_expert_tiles_hold_one_expert_each_and_every_pair_once(t, experts, k, block_m):
    _, _, ids = route(t, experts, k, 8, torch.float32, skew=t > 30)
    sorted_pairs, tile_expert, num_rows = moe.align_by_expert(ids, experts, block_m)
    pairs = t * k
    rows = int(num_rows)
    assert sorted_pairs.numel() % block_m == 0 and tile_expert.numel() == sorted_pairs.numel() // block_m
    assert sorted_pairs.numel() >= rows and rows % block_m == 0
    used = sorted_pairs[:rows]
    real = used[used < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # each pair exactly once, all inside the rows in use
    assert bool((sorted_pairs[rows:] == pairs).all())  # past them only padding
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=experts)
    assert rows == int(((counts + block_m - 1) // block_m * block_m).sum())
    for tile in range(rows // block_m):
        members = used[tile * block_m:(tile + 1) * block_m]
        members = members[members < pairs].long()
        assert members.numel() > 0, "no tile in use is all padding"
        assert bool((flat[members] == tile_expert[tile]).all())
        assert members.tolist() == sorted(members.tolist())  # token order within an expert


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("t,experts,k,inter,hidden,skew", [
    (1, 8, 2, 24, 40, False),    # a decode row; N and K not multiples of the tiles
    (19, 6, 3, 32, 64, True),    # empty and crowded experts, rows padded within a tile
    (70, 4, 2, 48, 96, False),   # more than a 64-row tile for an expert
])
def test_triton_fused_moe_matches_reference(triton_kernels, device, dtype, t, experts, k, inter, hidden, skew):
    x, weights, ids = route(t, experts, k, hidden, dtype, skew)
    w13, w2 = experts_weights(experts, inter, hidden, dtype)
    exact = reference.fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
    out = triton_kernels.fused_moe(x.to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device))
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        assert_close(out, exact.to(dtype), dtype)
    else:  # the gate-up and SiLU rows round to 16 bits between the matmuls (as every 16-bit MLP):
        # an element's error scales with the sums it came through, not with its own size
        err = (out.cpu().double() - exact).abs().max() / exact.abs().max()
        assert err <= (4e-3 if dtype == torch.float16 else 3e-2), f"relative error {err:.2e}"


def test_triton_fused_moe_without_tokens_and_with_bad_shapes(triton_kernels, device):
    w13, w2 = experts_weights(4, 8, 16, torch.float32)
    empty = torch.empty(0, 2, dtype=torch.int64, device=device)
    out = triton_kernels.fused_moe(torch.empty(0, 16, device=device), w13.to(device), w2.to(device),
                                   empty.float(), empty)
    assert out.shape == (0, 16)
    x, weights, ids = route(3, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="mixture of experts"):
        triton_kernels.fused_moe(x.to(device), w13.to(device), w2[:, :, :4].to(device), weights.to(device),
                                 ids.to(device))
    with pytest.raises(ValueError, match="must both be"):
        triton_kernels.fused_moe(x.to(device), w13.to(device), w2.to(device), weights[:, :1].to(device),
                                 ids.to(device))


def quantize_experts(w: torch.Tensor, kind: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> 8-bit values and float32 scales [E, N, ceil(K / group)], symmetric, as a
    checkpoint stores them (FP8 e4m3 to 448, INT8 to 127)."""
    e, n, k = w.shape
    groups = -(-k // group)
    padded = torch.zeros(e, n, groups * group)
    padded[..., :k] = w.float()
    top = 448.0 if kind == "fp8" else 127.0
    scale = (padded.view(e, n, groups, group).abs().amax(-1) / top).clamp(min=1e-8)
    full = scale.repeat_interleave(group, -1)[..., :k]
    q = (w.float() / full)
    q = q.to(torch.float8_e4m3fn) if kind == "fp8" else q.round().clamp(-128, 127).to(torch.int8)
    return q, scale


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("group", [128, 32, 0], ids=["block-128", "group-32", "per-channel"])
def test_8bit_experts_match_their_dequantized_weights(triton_kernels, device, kind, group):
    t, experts, k, inter, hidden = 21, 6, 2, 64, 256
    x, weights, ids = route(t, experts, k, hidden, torch.float32, skew=True)
    w13, w2 = experts_weights(experts, inter, hidden, torch.float32)
    q13, s13 = quantize_experts(w13, kind, group or hidden)
    q2, s2 = quantize_experts(w2, kind, group or inter)
    dense = reference.fused_moe(x, reference.dequantize_experts(q13, s13, torch.float32),
                                reference.dequantize_experts(q2, s2, torch.float32), weights, ids)
    assert torch.equal(reference.fused_moe(x, q13, q2, weights, ids, s13, s2), dense)
    assert torch.equal(moe.fused_moe(x, q13, q2, weights, ids, s13, s2), dense)
    out = triton_kernels.fused_moe(x.to(device), q13.to(device), q2.to(device), weights.to(device), ids.to(device),
                                   s13.to(device), s2.to(device))
    assert_close(out, dense, torch.float32)


def test_8bit_experts_with_the_wrong_scales_are_refused(triton_kernels, device):
    x, weights, ids = route(3, 4, 2, 16, torch.float32)
    w13, w2 = experts_weights(4, 8, 16, torch.float32)
    q13, s13 = quantize_experts(w13, "fp8", 16)
    q2, s2 = quantize_experts(w2, "fp8", 8)
    with pytest.raises(ValueError, match="both w13_scale and w2_scale"):
        moe.fused_moe(x, q13, q2, weights, ids, s13, None)
    with pytest.raises(ValueError, match="8-bit experts take FP8 or INT8 values"):
        triton_kernels.fused_moe(x.to(device), q13.to(device), q2.to(device), weights.to(device), ids.to(device),
                                 s13[:, :4].to(device), s2.to(device))
