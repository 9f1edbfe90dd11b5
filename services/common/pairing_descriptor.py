"""An engine's pairing descriptor: what a prefill and a decode must agree on, reported in GetLoad."""
from __future__ import annotations

import hashlib
import json
import struct

from engine.config import EngineConfig
from kvtransfer import KVLayout

from services.api.pdserve.v1 import pdserve_pb2 as pb

# The config.json keys that fix what a token's KV means (the weights have their own fingerprint,
# weights_fingerprint, sampled from the checkpoint's files).
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
                     "rope_parameters")  # the keys are cached after RoPE: its parameters count


def model_fingerprint(hf_config: dict, vocab: dict[str, int]) -> str:
    """sha256 over the architecture-defining config and the tokenizer's vocabulary: two engines
    with the same fingerprint read each other's token ids and KV the same way."""
    arch = {key: hf_config.get(key) for key in ARCHITECTURE_KEYS}
    digest = hashlib.sha256(b"model/v1\0")
    digest.update(json.dumps(arch, sort_keys=True).encode())
    digest.update(b"\0")
    digest.update(json.dumps(sorted(vocab.items())).encode())
    return digest.hexdigest()[:16]


WEIGHT_SAMPLE_BYTES = 64  # read at the start, middle and end of every tensor's data
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on a header


def weights_fingerprint(path: str) -> str:
    """sha256 over every tensor of the checkpoint's *.safetensors files: its name, dtype, shape and
    64 bytes from the start, middle and end of its data, in name order (so the same weights split
    into other files, or copied elsewhere, match). Three small reads a tensor (a few thousand for
    a 70B model), not a read of the checkpoint: a fine-tune or a re-quantisation changes the
    samples; identical samples over every tensor of two different checkpoints are not expected."""
    from engine.models.loader import safetensors_files  # torch: only engine processes import this module

    tensors = []
    for file in safetensors_files(path):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"{file}: a safetensors header of {size} bytes (corrupt?)")
            header = json.loads(f.read(size))
            base = 8 + size
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = (base + o for o in info["data_offsets"])
                samples = []
                for at in sorted({start, max(start, (start + end) // 2 - WEIGHT_SAMPLE_BYTES // 2),
                                  max(start, end - WEIGHT_SAMPLE_BYTES)}):
                    f.seek(at)
                    samples.append(f.read(min(WEIGHT_SAMPLE_BYTES, end - at)))
                tensors.append((name, info["dtype"], info["shape"], b"".join(samples)))
    digest = hashlib.sha256(b"weights/v1\0")
    for name, dtype, shape, sample in sorted(tensors, key=lambda t: t[0]):
        digest.update(json.dumps([name, dtype, shape]).encode())
        digest.update(b"\0")
        digest.update(sample)
    return digest.hexdigest()[:16]


def describe_engine(config: EngineConfig, vocab: dict[str, int], model_name: str,
                    kv_transport: str) -> pb.PairingDescriptor:
    """Computed once at start from the config the engine core runs with (the same checkpoint,
    block size and dtype), so GetLoad costs nothing more. `kv_transport` is empty when colocated."""
    from engine.models.llama import LlamaArch  # torch: only engine processes import this module
    from engine.models.loader import resolve_dtype, resolve_kv_cache_dtype

    hf_config = config.model.hf_config
    arch = LlamaArch.from_hf_config(hf_config)
    # The cache's own dtype (--kv-cache-dtype): a float8_e4m3fn prefill pairs with a like decode only.
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, resolve_dtype(config.model.dtype, hf_config))
    dtype = str(kv_dtype).removeprefix("torch.")
    # The model-level layout: every rank's shard of the same heads shares it, whatever the TP size.
    layout = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, config.cache.block_size, dtype=dtype)
    return pb.PairingDescriptor(
        model_name=model_name, model_fingerprint=model_fingerprint(hf_config, vocab),
        kv_layout_fingerprint=layout.fingerprint, kv_block_size=config.cache.block_size, kv_dtype=dtype,
        total_kv_heads=arch.num_kv_heads,
        tensor_parallel_size=config.parallel.tensor_parallel_size, kv_transport=kv_transport,
        weights_fingerprint=weights_fingerprint(config.model.path))
