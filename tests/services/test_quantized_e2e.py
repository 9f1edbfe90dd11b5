"""A quantized checkpoint through a real disaggregated stack (router, a prefill keeping its FP8
weights in 8 bits, a decode dequantizing them at load, KV over tcp): greedy completions
token-exact against the offline engine on the same checkpoint, which is itself checked against
transformers in tests/engine/test_quantized_checkpoints.py."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from stack import StackSpec, serving_as_offline

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fp8_model(e2e_model, tmp_path_factory) -> str:
    """The end-to-end model's projections in block-scaled FP8 (quant_method fp8, 128 x 128)."""
    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("fp8-model"))
    for name in os.listdir(e2e_model):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(e2e_model, name), out)
    tensors = load_file(os.path.join(e2e_model, "model.safetensors"))
    for name in [k for k in tensors if k.endswith("_proj.weight")]:
        w = tensors[name]
        grid = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        padded = torch.zeros(grid[0] * 128, grid[1] * 128)
        padded[:w.shape[0], :w.shape[1]] = w
        scale = padded.view(grid[0], 128, grid[1], 128).abs().amax(dim=(1, 3)) / 448.0
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
        tensors[name] = (w / full).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def test_an_fp8_checkpoint_serves_through_prefill_and_decode(fp8_model):
    spec = StackSpec(prefill_args=("--quantized-weights", "keep", "--quantization", "fp8"))
    with serving_as_offline(fp8_model, spec) as (stack, _, _):
        assert "projections kept as stored" in stack.prefills[0].output(last=10_000)
        assert "weights dequantized as they load" in stack.decodes[0].output(last=10_000)
        assert "dequantized as they load" not in stack.prefills[0].output(last=10_000)
