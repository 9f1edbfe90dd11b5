"""LoRA adapters (vLLM's --enable-lora / --lora-modules): PEFT checkpoints served beside the base
model, each request with its own (SamplingParams.lora_name) or none, in one batch.

An adapter's `lora_A` / `lora_B` pairs for the attention and MLP projections (q, k, v, o, gate,
up, down: PEFT's names for the Llama family) are loaded once at start, B scaled by lora_alpha / r
(or / sqrt(r) under use_rslora); the targets of one fused projection (q, k, v of qkv; gate, up)
become one pair per adapter, their A stacked and their B block-diagonal in the fused output. Each
step the model runner groups the batch's tokens by adapter; a projection's output then gets, for
each group, `(x @ A^T) @ B^T` added to its rows: two matmuls a group and projection. Tokens
without an adapter cost nothing; a step with none runs the base model as it is.

What a PEFT checkpoint may hold and this does not serve is refused at start, by name: adapters of
embeddings or the LM head, DoRA, biases, `modules_to_save`, ranks above --max-lora-rank.

Adapters come and go at run time too (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
through the router to every engine): `LoRAManager.add` loads one into a free slot between steps;
an unloaded one takes no new request at once and frees its slot once its last request finishes
(`EngineCore.remove_lora`).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import LoRAConfig
from engine.lora_errors import LoRAAdapterExistsError, LoRAOutOfMemoryError

# PEFT's module names -> (the fused projection here, which of its output slices).
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if os.path.exists(st):
        from safetensors.torch import load_file
        return load_file(st)
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors (or .bin)")


def _expected_shapes(arch) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module in the base model."""
    h, q, kv, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    # (layer, PEFT module name) -> (A [r, in], B [out, r] times the scaling)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def load(cls, name: str, path: str, arch, max_rank: int, dtype: torch.dtype,
             device: torch.device) -> "LoRAAdapter":
        where = f"LoRA adapter {name!r} ({path})"
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:
                cfg = json.load(f)
        except OSError as e:
            raise ValueError(f"{where}: cannot read adapter_config.json: {e}") from None
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are served")
        rank = int(cfg.get("r", 0))
        if not 1 <= rank <= max_rank:
            raise ValueError(f"{where}: rank {rank} is outside [1, --max-lora-rank {max_rank}]")
        for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
            if bool(cfg.get(key, False)) != ok:
                raise ValueError(f"{where}: {key} adapters are not served")
        if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
            raise ValueError(f"{where}: adapters with trained biases or modules_to_save are not served")
        if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
            raise ValueError(f"{where}: per-module rank_pattern / alpha_pattern is not served")
        alpha = float(cfg.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora", False) else alpha / rank
        shapes = _expected_shapes(arch)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in _read_tensors(path).items():
            m = _KEY.search(key)
            if m is None or m.group(2) not in TARGETS:
                raise ValueError(f"{where}: {key} adapts a module LoRA is not served on here (the attention "
                                 f"and MLP projections: {', '.join(TARGETS)})")
            layer = int(m.group(1))
            if layer >= arch.num_layers:
                raise ValueError(f"{where}: {key} names layer {layer}; the model has {arch.num_layers}")
            pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor
        adapter = cls(name, path, rank)
        for (layer, module), ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{where}: layer {layer} {module} has lora_{next(iter(ab))} without its pair")
            a, b = ab["A"], ab["B"]
            out_features, in_features = shapes[module]
            if a.shape != (rank, in_features) or b.shape != (out_features, rank):
                raise ValueError(f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)} do not fit the model's ({out_features}, {in_features}) "
                                 f"at rank {rank}")
            adapter.weights[(layer, module)] = (a.to(device=device, dtype=dtype).contiguous(),
                                                (b.float() * scaling).to(device=device, dtype=dtype).contiguous())
        if not adapter.weights:
            raise ValueError(f"{where}: no lora_A / lora_B weights")
        return adapter


class LoRABatch:
    """This step's tokens grouped by adapter slot: [(slot, their row indices on the device)]."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor]] = []

    def set(self, slots: np.ndarray) -> None:
        """`slots`: per token row of the step's forward, its adapter's slot (0: none)."""
        self.groups = []
        if not slots.any():
            return
        for slot in np.unique(slots[slots > 0]).tolist():
            rows = np.nonzero(slots == slot)[0]
            self.groups.append((slot, torch.from_numpy(rows).to(self.device)))


class LoRALayer:
    """The adapters of one (fused) projection. Per slot one (A, B) pair: the targets' A stacked
    ([sum of their ranks, in]) and their B placed block-diagonally in the projection's output
    ([out, sum of ranks], zeros elsewhere), so a group costs two matmuls whichever of the fused
    slices (q, k, v; gate, up) the adapter has."""

    def __init__(self, batch: LoRABatch, slices: list[tuple[int, int]]) -> None:
        self.batch = batch
        self.slices = slices  # (offset, size) in the projection's output
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, slot: int, parts: list) -> None:
        """`parts`: per output slice, (A [r, in], B [size, r]) or None (not adapted)."""
        present = [(i, pair) for i, pair in enumerate(parts) if pair is not None]
        a = torch.cat([pair[0] for _, pair in present])
        b = a.new_zeros(self.slices[-1][0] + self.slices[-1][1], a.shape[0])
        at = 0
        for i, (_, part_b) in present:
            offset, size = self.slices[i]
            b[offset:offset + size, at:at + part_b.shape[1]] = part_b
            at += part_b.shape[1]
        self.weights[slot] = (a.contiguous(), b.contiguous())

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds each group's deltas to `out` (the projection of `x`) in place."""
        for slot, rows in self.batch.groups:
            pair = self.weights.get(slot)
            if pair is not None:
                a, b = pair
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return out


class LoRAManager:
    """The engine's adapters, attached to its model: each in a slot of its own (1, 2, ...; 0 is the
    base model), --lora-modules' at start and those loaded at run time (`add` / `remove`)."""

    def __init__(self, config: LoRAConfig, model, dtype: torch.dtype, device: torch.device) -> None:
        self.batch = LoRABatch(device)
        self.slots: dict[str, int] = {}
        self.max_rank, self.dtype, self.device, self.arch = config.max_lora_rank, dtype, device, model.arch
        self.layers: dict[int, dict[str, LoRALayer]] = {}
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            attn.qkv_lora = LoRALayer(self.batch, [(0, q), (q, kv), (q + kv, kv)])
            attn.o_lora = LoRALayer(self.batch, [(0, self.arch.hidden_size)])
            mlp.gate_up_lora = LoRALayer(self.batch, [(0, mlp.intermediate_size),
                                                       (mlp.intermediate_size, mlp.intermediate_size)])
            mlp.down_lora = LoRALayer(self.batch, [(0, self.arch.hidden_size)])
            self.layers[i] = {"qkv": attn.qkv_lora, "o": attn.o_lora, "gate_up": mlp.gate_up_lora,
                              "down": mlp.down_lora}
        for name, path in config.modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> None:
        """Loads an adapter into the lowest free slot; raises ValueError (the checkpoint does not
        fit, or is not a LoRA adapter this serves; a file unreadable) with nothing changed."""
        if name in self.slots:
            raise LoRAAdapterExistsError(f"LoRA adapter {name!r} is already loaded")
        taken = set(self.slots.values())
        slot = next(s for s in range(1, len(taken) + 2) if s not in taken)
        try:
            adapter = LoRAAdapter.load(name, path, self.arch, self.max_rank, self.dtype, self.device)
            parts: dict[tuple[int, str], list] = {}
            for (layer, module), pair in adapter.weights.items():
                fused, part = TARGETS[module]
                parts.setdefault((layer, fused), [None] * len(self.layers[layer][fused].slices))[part] = pair
            for (layer, fused), pairs in parts.items():  # stacked by the layers; the adapter's own copies go
                self.layers[layer][fused].add(slot, pairs)
        except torch.OutOfMemoryError as e:
            self._clear(slot)
            raise LoRAOutOfMemoryError(f"LoRA adapter {name!r}: no device memory left for its weights ({e})") from None
        except BaseException:
            self._clear(slot)  # no layer keeps a part of it for the next adapter in this slot
            raise
        self.slots[name] = slot

    def remove(self, name: str) -> None:
        """Frees an adapter's weights and slot: no request of the batch may still use it."""
        self._clear(self.slots.pop(name))

    def _clear(self, slot: int) -> None:
        for modules in self.layers.values():
            for layer in modules.values():
                layer.weights.pop(slot, None)

    def set_batch(self, requests, tokens_per_request, total_rows: int) -> None:
        """The step's rows: each request's tokens in order, then padding (no adapter)."""
        slots = np.zeros(total_rows, dtype=np.int64)
        at = 0
        for r, n in zip(requests, tokens_per_request):
            slots[at:at + n] = self.slots.get(r.sampling_params.lora_name, 0)  # None: the base model
            at += n
        self.batch.set(slots)
