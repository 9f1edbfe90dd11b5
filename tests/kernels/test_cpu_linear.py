"""oneDNN-packed linear layers on the CPU: the same products as F.linear, in place of nn.Linear."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from kernels.cpu_linear import PackedLinear, onednn_supports, pack_linears

pytestmark = pytest.mark.skipif(not onednn_supports(torch.float32), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 16, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        want = linear(x)
        got = PackedLinear.of(linear)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_leading_dimensions():
    linear = nn.Linear(32, 48)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear.of(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_supports(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_packed_linear_bf16():
    linear = nn.Linear(128, 64).to(torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear.of(linear)(x).float(), linear(x).float(), rtol=2e-2, atol=2e-2)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def test_pack_linears_swaps_every_linear_and_leaves_the_embedding():
    model = Tied()
    ids = torch.tensor([3, 7, 49])
    with torch.inference_mode():
        want = model.head(model.proj(model.embed(ids)))
        assert pack_linears(model, "auto") == 2
        got = model.head(model.proj(model.embed(ids)))
    assert isinstance(model.proj, PackedLinear) and isinstance(model.head, PackedLinear)
    assert isinstance(model.embed.weight, nn.Parameter)  # a tied lm_head's packed copy is its own
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backend_choice():
    model = Tied()
    assert pack_linears(model, "torch") == 0 and type(model.proj) is nn.Linear
    with pytest.raises(ValueError, match="onednn needs CPU weights"):
        pack_linears(Tied().to(torch.float64), "onednn")
    assert pack_linears(Tied().to(torch.float64), "auto") == 0  # auto falls back to F.linear
    with pytest.raises(ValueError, match="linear backend must be"):
        pack_linears(Tied(), "mkl")


def test_engine_greedy_is_the_same_on_either_backend(tiny_model_factory):
    """The engine's default packs its weights on the CPU; greedy tokens equal F.linear's."""
    path = tiny_model_factory(arch="qwen2", tie_word_embeddings=True, max_position_embeddings=512)
    prompts = [[5, 9, 13, 2], list(range(3, 90)), [11] * 40]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for backend in ("onednn", "torch"):
        llm = LLM(path, linear_backend=backend, num_blocks=64, device="cpu")  # packing is the CPU's
        layer = llm.engine.runner.model.layers[0].mlp.down_proj
        assert isinstance(layer, PackedLinear) == (backend == "onednn")
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["onednn"] == outs["torch"]
    assert all(len(t) == 16 for t in outs["torch"])
