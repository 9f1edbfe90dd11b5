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
embeddings or the LM head, DoRA, biases, `modules_to_save`, ranks above --max-lora-rank, and on a
mixture of experts adapters of its experts (its attention and any dense layer's MLP take them).

Adapters come and go at run time too (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
through the router to every engine): `LoRAManager.add` loads one between steps; an unloaded one
takes no new request at once and frees its memory once its last request finishes
(`EngineCore.remove_lora`). Under --max-loras N the device holds N adapter slots, allocated at
start (the KV cache is sized around them, as vLLM's), and any number of adapters wait in host
memory for a step that runs them (`LoRAManager`); with --max-cpu-loras M, M at most, the others
read back from their files before a step runs them.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import LoRAConfig
from engine.lora_errors import LoRAAdapterExistsError, LoRAOutOfMemoryError

# PEFT's module names -> (the fused projection here, which of its output slices).
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
# A checkpoint that fuses them (Phi-3): an adapter of the fused module is one of each part, the same
# A with the part's rows of B (B A x, cut by rows, is each part's delta).
# GPT-NeoX's query_key_value holds each head's q, k and v rows in turn: its B is cut per head.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                 "query_key_value": ("q_proj", "k_proj", "v_proj")}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|attention|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# Other families' module names (the loader's renames): Phi's, StarCoder 2's, GPT-NeoX's.
_MODULE_NAMES = {("self_attn", "dense"): "o_proj", ("mlp", "fc1"): "up_proj", ("mlp", "fc2"): "down_proj",
                 ("mlp", "c_fc"): "up_proj", ("mlp", "c_proj"): "down_proj", ("attention", "dense"): "o_proj",
                 ("attention", "query_key_value"): "query_key_value", ("mlp", "dense_h_to_4h"): "up_proj",
                 ("mlp", "dense_4h_to_h"): "down_proj"}


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if os.path.exists(st):
        from safetensors.torch import load_file
        return load_file(st)
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors (or .bin)")


def _fingerprint(path: str) -> tuple:
    """An adapter folder's files as they are now (name, size, modification time): a read-back
    must find them as they were when the adapter loaded."""
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
        return tuple((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())
    except OSError:
        return ()


def _unfused(pairs: dict, shapes: dict[str, tuple[int, int]], where: str, num_heads: int) -> dict:
    """An adapter's pairs with each fused module's (FUSED_TARGETS) as its parts' pairs."""
    out = {}
    for (layer, module), ab in pairs.items():
        parts = FUSED_TARGETS.get(module)
        if parts is None or set(ab) != {"A", "B"}:
            out[(layer, module)] = ab
            continue
        sizes = [shapes[p][0] for p in parts]
        if ab["B"].shape[0] != sum(sizes):
            raise ValueError(f"{where}: layer {layer} {module}: lora_B has {ab['B'].shape[0]} rows; the model's "
                             f"{' + '.join(parts)} make {sum(sizes)}")
        b = ab["B"]
        if module == "query_key_value":  # [heads, 3, head_dim] rows: each part's rows of every head
            b = b.reshape(num_heads, 3, -1, b.shape[-1]).transpose(0, 1).reshape(b.shape)
        for part, rows in zip(parts, b.split(sizes)):
            if (layer, part) in pairs:
                raise ValueError(f"{where}: layer {layer} adapts both {module} and {part}")
            out[(layer, part)] = {"A": ab["A"], "B": rows}
    return out


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
             device: torch.device, layout=None) -> "LoRAAdapter":
        """layout (an engine.parallel.TPLayout): this rank's shard of each pair, as its projection
        is split: B's rows of a column-parallel one (q, k, v, gate, up; A whole), A's columns of a
        row-parallel one (o, down; B whole: each rank's delta is a partial sum, all-reduced with
        the projection's)."""
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
        if cfg.get("target_parameters"):  # PEFT's LoRA on parameters: a mixture's stacked experts
            raise ValueError(f"{where}: target_parameters {cfg['target_parameters']} (LoRA on parameters, such as a "
                             "mixture's experts) is not served; LoRA is served on the attention projections and "
                             "dense MLPs")
        if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
            raise ValueError(f"{where}: per-module rank_pattern / alpha_pattern is not served")
        alpha = float(cfg.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora", False) else alpha / rank
        shapes = _expected_shapes(arch)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in _read_tensors(path).items():
            m = _KEY.search(key)
            module = None if m is None else _MODULE_NAMES.get(
                (m.group(2), m.group(3)), m.group(3) if m.group(2) != "attention" else None)
            if module not in TARGETS and module not in FUSED_TARGETS:
                raise ValueError(f"{where}: {key} adapts a module LoRA is not served on here (the attention "
                                 f"and dense MLP projections: {', '.join(TARGETS)}, or fused "
                                 f"{', '.join(FUSED_TARGETS)}; not embeddings, the LM head or a mixture's experts)")
            layer = int(m.group(1))
            if layer >= arch.num_layers:
                raise ValueError(f"{where}: {key} names layer {layer}; the model has {arch.num_layers}")
            first = FUSED_TARGETS[module][0] if module in FUSED_TARGETS else module
            if layer in arch.sparse_layers and TARGETS[first][0] in ("gate_up", "down"):
                raise ValueError(f"{where}: {key}: layer {layer}'s MLP is a mixture of experts; LoRA is served on "
                                 "the attention projections and dense MLPs, not on experts")
            pairs.setdefault((layer, module), {})[m.group(4)] = tensor
        pairs = _unfused(pairs, shapes, where, arch.num_heads)
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
            split = None if layout is None else layout.split_of(f"layers.{layer}.{module}.weight")
            if split is not None:
                dim, start, end = split
                a, b = (a, b[start:end]) if dim == 0 else (a[:, start:end], b)
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
    """The adapters of one (fused) projection. Per slot one (A, B^T) pair: the targets' A stacked
    ([sum of their ranks, in]) and their B^T beside each other in the projection's output
    ([sum of ranks, out], zeros outside each target's slice), so a group costs two matmuls
    whichever of the fused slices (q, k, v; gate, up) the adapter has. Under --max-loras the
    slots are buffers at the widest rank allocated at start, an adapter's pair a view of its
    first rows (the same shapes, and the same sums, as an adapter of its own)."""

    def __init__(self, batch: LoRABatch, in_features: int, slices: list[tuple[int, int]]) -> None:
        self.batch = batch
        self.in_features = in_features
        self.slices = slices  # (offset, size) in the projection's output
        self.out_features = slices[-1][0] + slices[-1][1]
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def stack(self, parts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """`parts`: per output slice, (A [r, in], B [size, r]) or None (not adapted)."""
        present = [(i, pair) for i, pair in enumerate(parts) if pair is not None]
        a = torch.cat([pair[0] for _, pair in present])
        bt = a.new_zeros(a.shape[0], self.out_features)
        at = 0
        for i, (_, part_b) in present:
            offset, size = self.slices[i]
            bt[at:at + part_b.shape[1], offset:offset + size] = part_b.t()
            at += part_b.shape[1]
        return a.contiguous(), bt

    def reserve(self, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """--max-loras: the slots' memory, taken now (before the KV cache is sized around it)."""
        width = len(self.slices) * max_rank
        self.buffers = {slot: (torch.zeros(width, self.in_features, dtype=dtype, device=device),
                               torch.zeros(width, self.out_features, dtype=dtype, device=device))
                        for slot in range(1, num_slots + 1)}

    def put(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A stacked pair into a slot: its own tensors, or copied into the slot's buffers (from
        host memory: ordered after the steps already launched, which may read the slot's last)."""
        if self.buffers is None:
            self.weights[slot] = pair
            return
        a, bt = pair
        buf_a, buf_bt = self.buffers[slot]
        rank = a.shape[0]
        buf_a[:rank].copy_(a, non_blocking=True)
        buf_bt[:rank].copy_(bt, non_blocking=True)
        self.weights[slot] = (buf_a[:rank], buf_bt[:rank])

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds each group's deltas to `out` (the projection of `x`) in place."""
        for slot, rows in self.batch.groups:
            pair = self.weights.get(slot)
            if pair is not None:
                a, bt = pair
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ bt)
        return out


class LoRAManager:
    """The engine's adapters, attached to its model: --lora-modules' at start and those loaded at
    run time (`add` / `remove`), each in a slot of its own on the device (1, 2, ...; 0 is the
    base model).

    Without --max-loras every adapter loaded is on the device. With --max-loras N (vLLM's rule
    and memory): N slots at --max-lora-rank are allocated at start, before the KV cache is sized,
    so adapters never take memory the cache was given; every adapter loaded is kept in host memory
    (pinned on CUDA) and comes to the device when a step runs a request of it, into a free slot or
    in place of the one least recently run that this step does not need (the scheduler runs N
    adapters at most at a time). With --max-cpu-loras M as well, M adapters at most stay in host
    memory: the one run least recently beyond them is evicted and read back from its files
    (`stage`, before the step that runs it)."""

    def __init__(self, config: LoRAConfig, model, dtype: torch.dtype, device: torch.device, layout=None) -> None:
        """model: the engine's, or under tensor parallelism this rank's shard (and `layout` its
        TPLayout: each adapter is read whole and this rank keeps its shard of every pair)."""
        self.batch = LoRABatch(device)
        self.layout = layout
        self.slots: dict[str, int] = {}  # the adapters on the device
        self.max_rank, self.dtype, self.device, self.arch = config.max_lora_rank, dtype, device, model.arch
        self.num_slots = config.max_loras  # None: no cap, every adapter on the device
        self.host_cap = config.max_cpu_loras  # None: every adapter loaded stays in host memory
        # --max-loras: the adapters in host memory, stacked per projection, the least recently run first.
        self.host: OrderedDict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.paths: dict[str, str] = {}  # every adapter loaded, and where it was read from
        self._fingerprints: dict[str, tuple] = {}  # --max-cpu-loras: each one's files when it loaded
        self.reloads = 0  # adapters read back from their files (--max-cpu-loras)
        self._last_run: dict[str, int] = {}
        self._steps = 0
        self.swaps = 0  # adapters brought to the device for a step (--max-loras)
        self.layers: dict[int, dict[str, LoRALayer]] = {}
        h = self.arch.hidden_size
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            attn.qkv_lora = LoRALayer(self.batch, h, [(0, q), (q, kv), (q + kv, kv)])
            attn.o_lora = LoRALayer(self.batch, q, [(0, h)])
            self.layers[i] = {"qkv": attn.qkv_lora, "o": attn.o_lora}
            if i not in self.arch.sparse_layers:  # (a mixture's experts take no adapter: LoRAAdapter.load)
                inter, (gate, up) = mlp.intermediate_size, mlp.gate_up_sizes  # (a plain MLP: no gate rows)
                mlp.gate_up_lora = LoRALayer(self.batch, h, [(0, gate), (gate, up)])
                mlp.down_lora = LoRALayer(self.batch, inter, [(0, h)])
                self.layers[i].update(gate_up=mlp.gate_up_lora, down=mlp.down_lora)
            if self.num_slots is not None:
                for fused in self.layers[i].values():
                    fused.reserve(self.num_slots, self.max_rank, dtype, device)
        for name, path in config.modules:
            self.add(name, path)

    @property
    def loaded(self) -> set[str]:
        return set(self.paths)

    def device_bytes(self) -> int:
        """The device memory the adapters hold (the slots' buffers under --max-loras)."""
        tensors = [t for m in self.layers.values() for layer in m.values()
                   for pair in (layer.buffers or layer.weights).values() for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)

    def add(self, name: str, path: str) -> None:
        """Loads an adapter (into the lowest free slot, or host memory under --max-loras); raises
        ValueError (the checkpoint does not fit, or is not a LoRA adapter this serves; a file
        unreadable) with nothing changed."""
        if name in self.loaded:
            raise LoRAAdapterExistsError(f"LoRA adapter {name!r} is already loaded")
        slot = None
        try:
            on_host = self.num_slots is not None
            files = _fingerprint(path) if self.host_cap is not None else ()
            stacked = self._read(name, path, on_host)
            self.paths[name] = path
            self._fingerprints[name] = files
            if on_host:
                self.host[name] = stacked
                slot = self._free_slot()
                if slot is not None:  # on the device now: its first request does not wait for it
                    self._bring(name, slot)
                self._trim_host(keep={name})
            else:
                slot = next(s for s in range(1, len(self.slots) + 2) if s not in self.slots.values())
                for key, pair in stacked.items():
                    self.layers[key[0]][key[1]].put(slot, pair)
                self.slots[name] = slot
        except torch.OutOfMemoryError as e:
            self._drop(name, slot)
            where = "host" if self.num_slots is not None else "device"
            raise LoRAOutOfMemoryError(f"LoRA adapter {name!r}: no {where} memory left for its weights ({e})") \
                from None
        except BaseException:
            self._drop(name, slot)  # no layer keeps a part of it for the next adapter in this slot
            raise

    def _read(self, name: str, path: str, on_host: bool) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """An adapter's checkpoint, its pairs stacked per fused projection (in host memory, pinned on
        CUDA, under --max-loras; else on the device)."""
        adapter = LoRAAdapter.load(name, path, self.arch, self.max_rank, self.dtype,
                                   torch.device("cpu") if on_host else self.device, self.layout)
        parts: dict[tuple[int, str], list] = {}
        for (layer, module), pair in adapter.weights.items():
            fused, part = TARGETS[module]
            parts.setdefault((layer, fused), [None] * len(self.layers[layer][fused].slices))[part] = pair
        stacked = {}
        for (layer, fused), pairs in parts.items():  # stacked by the layers; the adapter's own copies go
            a, bt = self.layers[layer][fused].stack(pairs)
            if on_host and self.device.type == "cuda":  # copied to the device asynchronously
                a, bt = a.pin_memory(), bt.pin_memory()
            stacked[(layer, fused)] = (a, bt)
        return stacked

    def stage(self, names: set[str], keep: set[str] = frozenset()) -> dict[str, str]:
        """--max-cpu-loras: the adapters the next step may run (`Scheduler.adapters_to_run`) in
        host memory, each one evicted read back from its files, the least recently run others
        evicted beyond the cap (never those in `keep`: unloaded ones still finishing requests).
        Returns those that could not be read back (their files gone, changed since they loaded,
        unreadable; no memory): name -> why; they stay loaded, the next step that runs them tries
        again."""
        failed = {}
        keep = set(names) | set(keep)
        for name in sorted(names):
            if name in self.host:
                self.host.move_to_end(name)
            elif name not in self.slots and name in self.paths:  # (on the device it runs as it is)
                self._trim_host(keep, room=1)
                try:
                    self._reload(name)
                except Exception as e:  # noqa: BLE001 (whatever the files do, the engine serves on)
                    failed[name] = str(e) or type(e).__name__
        self._trim_host(keep)
        return failed

    def _reload(self, name: str) -> None:
        path = self.paths[name]
        if not os.path.isdir(path):
            raise FileNotFoundError("its folder is gone")
        if _fingerprint(path) != self._fingerprints.get(name):
            raise ValueError("its files changed since it was loaded (unload it and load it again to serve "
                             "the new ones)")
        self.host[name] = self._read(name, path, on_host=True)
        self.reloads += 1

    def _trim_host(self, keep: set[str], room: int = 0) -> None:
        """--max-cpu-loras: host copies beyond the cap (less `room`) go, the least recently run
        first (their adapters stay loaded: on the device as they are, or read back when run)."""
        if self.host_cap is None:
            return
        over = len(self.host) - max(0, self.host_cap - room)
        for name in [n for n in self.host if n not in keep][:max(0, over)]:
            del self.host[name]

    def keep_host_copies(self, names: list[str]) -> None:
        """Drops the host copies of adapters not in `names` (they are read back when run): a
        tensor-parallel worker keeping the copies rank 0 kept."""
        for name in [n for n in self.host if n not in names]:
            del self.host[name]

    def discard(self, name: str) -> None:
        """remove, if the adapter is loaded (a tensor-parallel worker undoing a load rank 0 undid)."""
        if name in self.loaded:
            self.remove(name)

    def remove(self, name: str) -> None:
        """Frees an adapter's weights and slot: no request of the batch may still use it."""
        if name not in self.loaded:
            raise KeyError(name)
        self._drop(name, self.slots.get(name))

    def _drop(self, name: str, slot: int | None) -> None:
        self.host.pop(name, None)
        self.paths.pop(name, None)
        self._fingerprints.pop(name, None)
        self._last_run.pop(name, None)
        if slot is not None:
            if self.slots.get(name) == slot:
                del self.slots[name]
            self._clear(slot)

    def _clear(self, slot: int) -> None:
        for modules in self.layers.values():
            for layer in modules.values():
                layer.weights.pop(slot, None)

    def _free_slot(self) -> int | None:
        taken = set(self.slots.values())
        return next((s for s in range(1, self.num_slots + 1) if s not in taken), None)

    def _bring(self, name: str, slot: int) -> None:
        self._clear(slot)  # the last adapter's projections this one does not adapt
        for (layer, fused), pair in self.host[name].items():
            self.layers[layer][fused].put(slot, pair)
        self.slots[name] = slot

    def _to_device(self, names: set[str]) -> None:
        """--max-loras: this step's adapters on the device, each missing one into a free slot or
        that of the adapter run least recently that this step does not run."""
        self._steps += 1
        for name in sorted(names):
            if name not in self.slots and name not in self.host and name in self.paths:
                self._reload(name)  # never expected: the engine core stages a step's adapters before it schedules
                self._trim_host(keep=names)
            if name in self.host:
                self.host.move_to_end(name)
            if name not in self.slots and name in self.host:
                slot = self._free_slot()
                if slot is None:
                    idle = [n for n in self.slots if n not in names]
                    if not idle:
                        raise RuntimeError(f"a step runs {len(names)} LoRA adapters; --max-loras "
                                           f"{self.num_slots} slots hold them")
                    victim = min(idle, key=lambda n: self._last_run.get(n, 0))
                    slot = self.slots.pop(victim)
                self._bring(name, slot)
                self.swaps += 1
            self._last_run[name] = self._steps

    def set_batch(self, names: list[str | None], tokens_per_request, total_rows: int) -> None:
        """The step's rows: each request's tokens in order (`names`: each one's adapter or None),
        then padding (no adapter)."""
        if self.num_slots is not None:
            self._to_device({n for n in names if n is not None})
        slots = np.zeros(total_rows, dtype=np.int64)
        at = 0
        for name, n in zip(names, tokens_per_request):
            slots[at:at + n] = self.slots.get(name, 0)  # None: the base model
            at += n
        self.batch.set(slots)
