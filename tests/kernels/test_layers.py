"""Triton RMSNorm (+ residual), SiLU-and-multiply and rotary embedding (Neox style and interleaved)
against the torch reference."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import DTYPE_IDS, DTYPES, assert_close, assert_same
from kernels import reference


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_hf_semantics(triton_kernels, device, dtype, with_residual):
    x = torch.randn(19, 96, dtype=dtype) * 3  # 96: not a power of two, so the row tile is masked
    residual = torch.randn_like(x) if with_residual else None
    weight = torch.randn(96, dtype=dtype)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)

    x_dev = x.to(device)
    normed, new_residual = triton_kernels.rms_norm(
        x_dev, weight.to(device), 1e-6, residual.to(device) if with_residual else None)
    assert_close(normed, expected, dtype)
    if with_residual:
        assert_close(new_residual, expected_residual, dtype)
    else:
        assert new_residual is x_dev  # as the reference: the input itself is the next residual


def test_rms_norm_keeps_hf_dtype_promotion_and_leading_dims(triton_kernels, device):
    # A float32 weight over float16 activations gives float32, as in HF; q/k norms run per head.
    x = torch.randn(5, 4, 64, dtype=torch.float16)
    weight = torch.randn(64, dtype=torch.float32)
    expected, _ = reference.rms_norm(x, weight, 1e-5)
    normed, _ = triton_kernels.rms_norm(x.to(device), weight.to(device), 1e-5)
    assert normed.shape == expected.shape and normed.dtype == torch.float32
    # The normalised row is rounded to float16 before the float32 weight scales it (as HF), so
    # an rsqrt one float32 ulp off the reference's may round it one float16 ulp the other way.
    assert_close(normed, expected, torch.float16)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rot_dim", [64, 32], ids=["full", "partial"])
def test_rotary_embedding_matches_reference(triton_kernels, device, dtype, rot_dim, interleaved):
    num_tokens, num_heads, num_kv_heads, head_dim, max_pos = 11, 6, 2, 64, 300
    # q and k as the model makes them: views into one fused QKV projection.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    query = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,))
    cos_sin_cache = torch.randn(max_pos, rot_dim)
    expected_q, expected_k = reference.rotary_embedding(positions, query, key, cos_sin_cache, interleaved)

    q_dev, k_dev = query.to(device), key.to(device)
    q, k = triton_kernels.rotary_embedding(positions.to(device), q_dev, k_dev, cos_sin_cache.to(device),
                                           interleaved)
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)
    if rot_dim < head_dim:  # the dims past rot_dim pass through untouched
        assert_same(q[..., rot_dim:], query[..., rot_dim:])
    assert torch.equal(q_dev, query.to(device)) and torch.equal(k_dev, key.to(device))  # new tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(19, 2 * 96), (3, 5, 2 * 1100), (0, 2 * 64)], ids=["rows", "3d-2tiles", "empty"])
def test_silu_and_mul_matches_hf_mlp(triton_kernels, device, dtype, shape):
    x = torch.randn(*shape, dtype=dtype) * 4  # 96, 1100: masked tiles; 1100 > 1024: two tiles a row
    expected = reference.silu_and_mul(x)
    got = triton_kernels.silu_and_mul(x.to(device))
    assert got.shape == expected.shape and got.dtype == dtype
    assert_close(got, expected, dtype)


def test_silu_and_mul_reads_strided_rows(triton_kernels, device):
    x = torch.randn(6, 2 * 80, dtype=torch.float32)
    strided = torch.randn(6, 3 * 80, dtype=torch.float32)[:, :160]
    strided.copy_(x)
    assert_close(triton_kernels.silu_and_mul(strided.to(device)), reference.silu_and_mul(x), torch.float32)
