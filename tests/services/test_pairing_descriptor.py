"""The pairing descriptor an engine reports in GetLoad: what tells two checkpoints, block sizes,
dtypes and TP sizes apart, and what does not."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.processor import load_tokenizer
from kvtransfer import KVLayout
from services.common.pairing_descriptor import describe_engine, model_fingerprint
from services.router.pairing import pair_incompatibility


def describe(path: str, transport: str = "tcp", **engine_kwargs):
    return describe_engine(EngineConfig.create(path, **engine_kwargs), load_tokenizer(path).get_vocab(), "m",
                           transport)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def test_the_descriptor_says_what_the_kv_cache_is(tiny):
    d = describe(tiny, block_size=32, dtype="bfloat16", tensor_parallel_size=2)
    # The tiny llama: 2 layers, 2 KV heads of 16 (hidden 64 / 4 heads).
    assert (d.kv_block_size, d.kv_dtype, d.total_kv_heads, d.tensor_parallel_size, d.kv_transport) == (
        32, "bfloat16", 2, 2, "tcp")
    assert d.kv_layout_fingerprint == KVLayout(2, 2, 16, 32, dtype="bfloat16").fingerprint
    assert pair_incompatibility(d, describe(tiny, block_size=32, dtype="bfloat16")) is None  # TP 2 feeds TP 1


def test_block_size_and_dtype_change_the_layout_not_the_model(tiny):
    base = describe(tiny)
    for other, why in ((describe(tiny, block_size=32), "KV block size 16 vs 32"),
                       (describe(tiny, dtype="float16"), "KV dtype float32 vs float16"),
                       (describe(tiny, kv_cache_dtype="fp8"), "KV dtype float32 vs float8_e4m3fn"),
                       (describe(tiny, transport="shm"), "KV transport tcp vs shm")):
        assert other.model_fingerprint == base.model_fingerprint
        assert pair_incompatibility(base, other) == why


def test_an_fp8_cache_pairs_with_the_same_fp8_cache(tiny):
    fp8 = describe(tiny, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fp8.kv_dtype == "float8_e4m3fn"
    assert fp8.kv_layout_fingerprint == KVLayout(2, 2, 16, 16, dtype="float8_e4m3fn").fingerprint
    # The model's dtype is not the cache's: a float16 engine's fp8 cache is the same bytes.
    assert pair_incompatibility(fp8, describe(tiny, dtype="float16", kv_cache_dtype="fp8_e4m3")) is None
    assert pair_incompatibility(fp8, describe(tiny, dtype="bfloat16", kv_cache_dtype="fp8_e5m2")) == \
        "KV dtype float8_e4m3fn vs float8_e5m2"


def test_another_checkpoint_is_another_model(tiny, tiny_model_factory):
    base = describe(tiny)
    deeper = describe(tiny_model_factory("llama", num_layers=3))
    assert deeper.model_fingerprint != base.model_fingerprint
    assert pair_incompatibility(base, deeper).startswith("model m")
    # The same architecture with a longer context is the same model: its KV means the same.
    assert describe(tiny_model_factory("llama", max_position_embeddings=512)).model_fingerprint == base.model_fingerprint


def test_the_tokenizer_is_part_of_the_model(tiny):
    hf_config = EngineConfig.create(tiny).model.hf_config
    vocab = load_tokenizer(tiny).get_vocab()
    renamed = dict(vocab)
    token = next(t for t in renamed if renamed[t] > 10)
    renamed[token + "_x"] = renamed.pop(token)  # one id spelled differently
    assert model_fingerprint(hf_config, vocab) == model_fingerprint(hf_config, dict(reversed(vocab.items())))
    assert model_fingerprint(hf_config, vocab) != model_fingerprint(hf_config, renamed)


def _rewrite(src: str, dst: str, change=None, shards: int = 1) -> str:
    """A copy of checkpoint `src` at `dst`: its tensors (after `change`) written into `shards` files."""
    import glob
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {}
    for file in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors.update(load_file(file))
        os.remove(file)
    if change:
        change(tensors)
    names = sorted(tensors)
    for i in range(shards):
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, os.path.join(dst, f"model-{i + 1:05d}-of-{shards:05d}.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_fine_tune_of_the_same_architecture_is_another_model(tiny, tmp_path):
    """Same config and tokenizer, other weights (a fine-tune, or a rolling update to the next
    checkpoint): its KV means something else, so a prefill of one never feeds a decode of the other."""
    base = describe(tiny)

    def fine_tune(tensors):
        name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
        tensors[name] = tensors[name] * 1.01

    tuned = describe(_rewrite(tiny, str(tmp_path / "tuned"), fine_tune))
    assert tuned.model_fingerprint == base.model_fingerprint  # architecture and tokenizer alike
    assert tuned.weights_fingerprint != base.weights_fingerprint
    reason = pair_incompatibility(base, tuned)
    assert reason.startswith("model weights of m") and "another checkpoint" in reason
    # One engine older than the field (it reports none): paired on the rest, as before.
    older = type(tuned)()
    older.CopyFrom(tuned)
    older.weights_fingerprint = ""
    assert pair_incompatibility(base, older) is None


def test_the_same_weights_split_or_copied_elsewhere_are_the_same_model(tiny, tmp_path, tiny_model_factory):
    base = describe(tiny)
    assert len(base.weights_fingerprint) == 16
    for dst, shards in (("copy", 1), ("split", 3)):
        other = describe(_rewrite(tiny, str(tmp_path / dst), shards=shards))
        assert other.weights_fingerprint == base.weights_fingerprint
        assert pair_incompatibility(base, other) is None
    # A changed architecture is named once, as the model (not again as its weights).
    deeper = describe(tiny_model_factory("llama", num_layers=3))
    assert deeper.weights_fingerprint != base.weights_fingerprint
    assert "weights" not in pair_incompatibility(base, deeper)


def test_a_corrupt_checkpoint_header_is_refused(tmp_path):
    from services.common.pairing_descriptor import weights_fingerprint

    (tmp_path / "model.safetensors").write_bytes((2 ** 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header"):
        weights_fingerprint(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        weights_fingerprint(str(tmp_path / "missing"))
