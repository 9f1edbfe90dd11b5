"""Quantized checkpoints: the weights of FP8, INT8 and packed INT4 checkpoints (as vLLM serves
them: `quant_method` "fp8" — DeepSeek's and Qwen's block-scaled FP8, per-tensor AutoFP8 —,
"fbgemm_fp8", and "compressed-tensors" from llm-compressor: float-quantized FP8, int-quantized
INT8, pack-quantized W4A16 / W8A16; "awq", AutoAWQ's GEMM layout; "gptq", AutoGPTQ's and
GPTQModel's) are dequantized to the engine's dtype as they load, or (with
--quantized-weights keep) the projections are kept as stored for kernels.quant_linear (`kept`).
The model then serves what the checkpoint holds: every weight exactly `(q - zero_point) * scale`,
token-exact against transformers in float32. Activations are quantized as the checkpoint says
(W8A8) only for FP8 weights scaled per channel or tensor under keep (kernels.quant_linear's
torch._scaled_mm); otherwise a W8A8 checkpoint answers as its W8A16 form.

Anything else (bitsandbytes, GGUF, AWQ's GEMV layout, ...) is refused at start, by name."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kernels.quant_linear import unpack_signed

SERVED = ("fp8", "fbgemm_fp8", "compressed-tensors", "awq", "gptq")
_CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
# A quantized weight's companions in the checkpoint (module prefix + suffix).
COMPANIONS = ("weight_scale_inv", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale",
              "input_zero_point", "output_scale",
              "qzeros", "scales", "g_idx")  # AWQ's and GPTQ's (their weight: `qweight`)
# AutoAWQ's GEMM packing: the value of column 8j + AWQ_ORDER[i] sits at bits 4i of word j.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class KeptWeight:
    """A weight as --quantized-weights keep holds it: `q` [out, in] FP8 / INT8 values, or INT4
    packed [out, ceil(in / 8)] int32; scales float32 [out, groups]; zero points int8 or None."""
    q: torch.Tensor
    kind: str  # fp8 | int8 | int4
    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int

    def part(self, dim: int, start: int, end: int, module: str) -> "KeptWeight":
        """Rows (dim 0) or columns (dim 1) [start, end) of the weight, with their scales and zero
        points: a tensor-parallel rank's shard (engine.parallel.TPLayout.split_of). Columns split
        on the column groups' edges, or within one group, and INT4 on its eight-value words;
        ValueError, naming the widths, where a rank's share would cut them."""
        if dim == 0:
            return KeptWeight(self.q[start:end], self.kind, self.scale[start:end],
                              None if self.zero is None else self.zero[start:end], self.group)
        width = end - start
        if self.scale.shape[1] == 1:  # one scale a row (per channel or tensor, or one block wide)
            groups, group = slice(None), min(width, self.group)
        elif width % self.group == 0 or self.group % width == 0:
            groups, group = slice(start // self.group, (end - 1) // self.group + 1), self.group
        else:
            raise ValueError(f"{module}: tensor parallelism gives each rank {width} of its input columns, which cuts "
                             f"its quantization groups of {self.group}: use a --tensor-parallel-size that divides "
                             "them evenly, or --quantized-weights dequantize")
        if self.kind == "int4":
            if width % 8:
                raise ValueError(f"{module}: tensor parallelism gives each rank {width} of its input columns, which "
                                 "cuts its INT4 words of 8: use another --tensor-parallel-size, or "
                                 "--quantized-weights dequantize")
            q = self.q[:, start // 8:end // 8]
        else:
            q = self.q[:, start:end]
        return KeptWeight(q.contiguous(), self.kind, self.scale[:, groups].contiguous(),
                          None if self.zero is None else self.zero[:, groups].contiguous(), group)


@dataclass(frozen=True)
class _Scheme:
    """One config group's weights: bits, and the block a scale covers ((rows, columns); None:
    read from the scale's shape: per tensor, per output channel)."""
    num_bits: int = 8
    block: tuple[int, int] | None = None
    symmetric: bool = True
    kind: str = "float"  # the stored values: float (FP8) or int
    # 8-bit activations (the weights' type) as the checkpoint quantizes them: "token" / "tensor"
    # (dynamic scales), "static" (its input_scale), None (not quantized). --quantized-weights keep
    # runs them (W8A8).
    activations: str | None = None
    activation_ub: float | None = None  # fbgemm_fp8: a row's amax at most this
    targets: tuple[str, ...] = ("Linear",)


class QuantizedWeights:
    """A checkpoint's quantization_config, read at start; `dequantize` rebuilds each weight."""

    def __init__(self, method: str, schemes: list[_Scheme], packed: bool, gptq_v1: bool = False,
                 desc_act: bool = False) -> None:
        self.method, self.schemes, self.packed = method, schemes, packed
        self.gptq_v1, self.desc_act = gptq_v1, desc_act  # GPTQ: zeros stored less one; act-order g_idx

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "QuantizedWeights | None":
        qc = hf_config.get("quantization_config")
        if not qc:
            return None
        method = str(qc.get("quant_method", "")).lower()
        if method not in SERVED:
            raise ValueError(f"quantized checkpoint (quant_method {method or '?'!r}) is not served; pdserve serves "
                             f"{', '.join(SERVED)} checkpoints (FP8, INT8 and packed INT4/INT8 weights) and "
                             "unquantized ones")
        if method == "fp8":
            block = qc.get("weight_block_size")
            # Block-scaled FP8 quantizes activations per group of 128 (vLLM): not run here, W8A16.
            acts = None if block else {"dynamic": "tensor", "static": "static"}.get(
                str(qc.get("activation_scheme", "dynamic")))
            return cls(method, [_Scheme(8, tuple(block) if block else None, activations=acts)], packed=False)
        if method == "fbgemm_fp8":
            ub = qc.get("activation_scale_ub")
            return cls(method, [_Scheme(8, activations="token", activation_ub=None if ub is None else float(ub))],
                       packed=False)
        if method in ("awq", "gptq"):
            return cls._awq_gptq(method, qc)
        sparsity = (qc.get("sparsity_config") or {}).get("format", "dense")
        if sparsity not in ("dense", None):
            raise ValueError(f"compressed-tensors checkpoint with {sparsity!r} sparsity is not served (dense only)")
        if qc.get("transform_config"):
            raise ValueError("compressed-tensors checkpoint with a transform_config (online rotations: SpinQuant, "
                             "QuIP) is not served")
        if not qc.get("config_groups") and qc.get("kv_cache_scheme"):
            return None  # only the KV cache is quantized: dense weights (its scales: loader._KV_SCALE)
        fmt = qc.get("format", "")
        if fmt not in _CT_FORMATS:
            raise ValueError(f"compressed-tensors checkpoint of format {fmt!r} is not served; pdserve serves "
                             f"{', '.join(_CT_FORMATS)}")
        schemes = []
        for name, group in (qc.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            where = f"compressed-tensors config group {name!r}"
            if w.get("type", "int") not in ("int", "float"):
                raise ValueError(f"{where}: weights of type {w.get('type')!r} are not served")
            bits = int(w.get("num_bits", 8))
            if w.get("type") == "float" and bits != 8 or bits not in (4, 8):
                raise ValueError(f"{where}: {bits}-bit {w.get('type', 'int')} weights are not served "
                                 "(8-bit float, 4- and 8-bit int are)")
            strategy = w.get("strategy") or "tensor"
            if w.get("actorder") not in (None, False, "static", "weight") or strategy == "tensor_group":
                raise ValueError(f"{where}: strategy {strategy!r} with actorder {w.get('actorder')!r} is not served")
            block = None
            if strategy == "group":
                block = (1, int(w["group_size"]))
            elif strategy == "block":
                block = tuple(int(x) for x in w["block_structure"])
            elif strategy not in ("tensor", "channel"):
                raise ValueError(f"{where}: weight strategy {strategy!r} is not served")
            acts = None
            ia = group.get("input_activations") or {}
            # W8A8: 8-bit activations of the weights' type (FP8 with FP8, INT8 with INT8), symmetric.
            if ia and ia.get("type", "int") == w.get("type", "int") and int(ia.get("num_bits", 8)) == 8 \
                    and bits == 8 and ia.get("symmetric", True):
                acts = "static" if not ia.get("dynamic", False) else (ia.get("strategy") or "tensor")
                if acts not in ("token", "tensor", "static"):
                    acts = None  # another granularity: served as W8A16
            schemes.append(_Scheme(bits, block, bool(w.get("symmetric", True)), w.get("type", "int"),
                                   activations=acts, targets=tuple(group.get("targets") or ("Linear",))))
        if not schemes:
            raise ValueError("compressed-tensors checkpoint without config_groups")
        return cls(method, schemes, packed=fmt == "pack-quantized")

    @classmethod
    def _awq_gptq(cls, method: str, qc: dict) -> "QuantizedWeights":
        """AutoAWQ's GEMM checkpoints (4 bits, zero points) and AutoGPTQ / GPTQModel's (4 or 8
        bits; group_size -1: a group per row; desc_act's g_idx)."""
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if qc.get("dynamic"):
            raise ValueError(f"{method} checkpoint with per-module `dynamic` overrides is not served")
        if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise ValueError(f"{method} checkpoint packed in {qc['pack_dtype']} words is not served (int32 is)")
        if qc.get("is_marlin_format") or str(qc.get("format") or "").lower() == "marlin":
            raise ValueError(f"{method} checkpoint in the Marlin layout is not served")
        if method == "awq":
            version = str(qc.get("version") or qc.get("format") or "gemm").lower()
            if version != "gemm" or bits != 4 or not qc.get("zero_point", True):
                raise ValueError(f"AWQ checkpoint (version {version!r}, {bits} bits, zero_point "
                                 f"{qc.get('zero_point', True)}) is not served; pdserve serves AutoAWQ's GEMM "
                                 "layout at 4 bits with zero points")
        else:
            fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
            if fmt not in ("gptq", "gptq_v2") or bits not in (4, 8):
                raise ValueError(f"GPTQ checkpoint ({bits} bits, checkpoint_format {fmt!r}) is not served; pdserve "
                                 "serves 4- and 8-bit gptq and gptq_v2 checkpoints")
        if group == 0 or group < -1:
            raise ValueError(f"{method} checkpoint with group_size {group}")
        scheme = _Scheme(bits, None if group == -1 else (1, group), symmetric=bool(qc.get("sym", False)), kind="int")
        return cls(method, [scheme], packed=False, gptq_v1=method == "gptq" and fmt == "gptq",
                   desc_act=bool(qc.get("desc_act")))

    def _awq_gptq_values(self, module: str, qweight: torch.Tensor,
                         companions: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """An AWQ / GPTQ weight unpacked: (values [N, K], zero points [N, groups], scales
        [N, groups], each input column's group [K]); W[n, k] = (q - zero[n, g[k]]) * scale[n, g[k]]."""
        scales, qzeros = companions.get("scales"), companions.get("qzeros")
        if scales is None or qzeros is None:
            raise ValueError(f"{self.method} weight {module}.qweight has no scales / qzeros in the checkpoint")
        bits = self.schemes[0].num_bits
        if self.method == "awq":  # qweight [K, N / 8], qzeros [groups, N / 8], packed along N in AWQ's order
            q = _unpack_columns(qweight, bits, AWQ_REVERSE_ORDER)
            zero = _unpack_columns(qzeros, bits, AWQ_REVERSE_ORDER)
        else:  # qweight [K * bits / 32, N] packed along K; qzeros [groups, N * bits / 32] along N
            q = _unpack_rows(qweight, bits)
            if self.gptq_v1:  # each zero stored less one, word-wise (a zero of 0 borrows from the next)
                qzeros = qzeros.to(torch.int64) + (0x11111111 if bits == 4 else 0x01010101)
            zero = _unpack_columns(qzeros, bits)
        n = scales.shape[1]
        k = q.shape[0]
        q, zero = q[:, :n], zero[:, :n]
        block = self.schemes[0].block
        g_idx = companions.get("g_idx")
        if g_idx is None or not g_idx.numel():
            g_idx = torch.arange(k) // (block[1] if block is not None else k)
        if scales.shape[0] != zero.shape[0] or int(g_idx.max()) >= scales.shape[0] or g_idx.shape[0] != k:
            raise ValueError(f"{module}: {self.method} scales {tuple(scales.shape)}, zeros {tuple(zero.shape)} and "
                             f"g_idx do not fit a weight of ({n}, {k})")
        return q.t().contiguous(), zero.t().contiguous(), scales.t().to(torch.float32).contiguous(), g_idx.long()

    def describe(self) -> str:
        return f"{self.method} ({', '.join(sorted({f'{s.num_bits}-bit' for s in self.schemes}))} weights)"

    def _scheme(self, module: str) -> _Scheme:
        """The config group whose targets name the module, as compressed-tensors ranks them: a
        module's name over a `re:` pattern over a class (`Linear` takes any projection)."""
        for rank in range(3):
            for scheme in self.schemes:
                for target in scheme.targets:
                    if rank == 0 and (module == target or module.endswith("." + target)) or \
                            rank == 1 and target.startswith("re:") and re.match(target[3:], module) or \
                            rank == 2 and target == "Linear":
                        return scheme
        return self.schemes[0]

    def kept(self, module: str, stored: torch.Tensor, companions: dict[str, torch.Tensor],
             in_features: int) -> "KeptWeight":
        """--quantized-weights keep: one stored weight as the fused linear reads it (8-bit FP8
        or INT8 values, or INT4 packed eight to an int32 as compressed-tensors stores them), its
        float32 scales per row and group of columns, and int8 zero points when it has them."""
        scheme = self._scheme(module)
        if self.method in ("awq", "gptq"):
            return self._kept_awq_gptq(module, stored, companions, in_features)
        scale = companions.get("weight_scale_inv", companions.get("weight_scale"))
        if scale is None:
            raise ValueError(f"quantized weight {module}.weight has no weight_scale in the checkpoint")
        if stored.dtype == torch.int32:  # pack-quantized
            shape = companions.get("weight_shape")
            if shape is None:
                raise ValueError(f"packed weight {module!r} has no weight_shape in the checkpoint")
            out, cols = (int(x) for x in shape.tolist())
            if scheme.num_bits == 4:
                if stored.shape != (out, -(-cols // 8)):
                    raise ValueError(f"{module}: a packed weight of {tuple(stored.shape)} for ({out}, {cols}) "
                                     "at 4 bits")
                q, kind = stored, "int4"
            else:
                q, kind = unpack_int32(stored, 8, (out, cols)).to(torch.int8), "int8"
        elif stored.dtype in (torch.float8_e4m3fn, torch.int8):
            q, kind = stored, "fp8" if stored.dtype == torch.float8_e4m3fn else "int8"
        else:
            raise ValueError(f"{module}: --quantized-weights keep runs 8-bit and packed 4-bit weights, not "
                             f"weights stored as {stored.dtype}: use --quantized-weights dequantize")
        out = q.shape[0]
        group = self.group_of(module, in_features)
        zero = self._zero_point(companions, scale, scheme)
        rows = [None if grid is None else row_grid(grid.float(), out, in_features, scheme.block, module)
                for grid in (scale.to(torch.float32), zero)]
        zero_rows = None if rows[1] is None or not bool(rows[1].any()) else rows[1].to(torch.int8)
        return KeptWeight(q, kind, rows[0], zero_rows, group)

    def _kept_awq_gptq(self, module: str, qweight: torch.Tensor, companions: dict[str, torch.Tensor],
                       in_features: int) -> "KeptWeight":
        """AWQ / GPTQ's unsigned values and zero points, repacked as compressed-tensors stores
        INT4 (signed, eight to an int32 along the row) or as INT8: (q - 2^(b-1)) - (zero - 2^(b-1))."""
        q, zero, scale, g_idx = self._awq_gptq_values(module, qweight, companions)
        group = self.group_of(module, in_features)
        if not torch.equal(g_idx, torch.arange(in_features) // group):
            raise ValueError(f"{module}: --quantized-weights keep runs groups of consecutive columns; this "
                             "checkpoint's act-order (desc_act) g_idx permutes them: use --quantized-weights dequantize")
        bits = self.schemes[0].num_bits
        offset = 1 << (bits - 1)
        if int(zero.min()) < 0 or int(zero.max()) >= 1 << bits:
            raise ValueError(f"{module}: zero points outside [0, {(1 << bits) - 1}]")
        if bits == 4:
            kind, stored = "int4", pack_int4(q - offset)
        else:
            kind, stored = "int8", (q - offset).to(torch.int8)
        return KeptWeight(stored, kind, scale, (zero - offset).to(torch.int8), group)

    @staticmethod
    def _zero_point(companions: dict[str, torch.Tensor], scale: torch.Tensor, scheme: _Scheme) -> torch.Tensor | None:
        """The weight's zero points as stored values (compressed-tensors packs those of the group
        and channel strategies into int32 along the output rows)."""
        zero = companions.get("weight_zero_point")
        if zero is None or not zero.numel():
            return None
        if zero.dtype == torch.int32:
            grid = scale.reshape(scale.shape[0], -1).shape if scale.numel() > 1 else (1, 1)
            zero = unpack_int32(zero.t().contiguous(), scheme.num_bits, (grid[1], grid[0])).t()
        return zero

    @staticmethod
    def has_zero_points(companions: dict[str, torch.Tensor]) -> bool:
        zero = companions.get("weight_zero_point")
        return "qzeros" in companions or zero is not None and zero.numel() > 0 and bool(zero.any())

    def activations_of(self, module: str) -> str | None:
        return self._scheme(module).activations

    def activation_ub_of(self, module: str) -> float | None:
        return self._scheme(module).activation_ub

    def bits_of(self, module: str) -> int:
        return self._scheme(module).num_bits

    def is_float(self, module: str) -> bool:
        return self._scheme(module).kind == "float"

    def group_of(self, module: str, in_features: int) -> int:
        """The width of a kept weight's column groups (the row, or the block / group)."""
        block = self._scheme(module).block
        return in_features if block is None else block[1]

    def is_companion(self, hf_name: str) -> bool:
        return hf_name.rsplit(".", 1)[-1] in COMPANIONS

    def main_name(self, hf_name: str) -> str | None:
        """The weight a stored tensor is (`weight_packed` holds `weight`); None: not a weight."""
        if self.packed and hf_name.endswith(".weight_packed"):
            return hf_name[:-len("_packed")]
        if hf_name.endswith(".qweight"):
            return hf_name[:-len("qweight")] + "weight"
        return hf_name

    def dequantize(self, hf_name: str, tensor: torch.Tensor, companions: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> torch.Tensor:
        """`tensor` as stored under `hf_name` (the weight, or `weight_packed`), with its module's
        companions ({suffix: tensor}); a tensor with no scale (a bias, a norm, an unquantized
        module's weight) is returned as it is."""
        if not hf_name.endswith((".weight", ".weight_packed", ".qweight")):
            return tensor
        module = hf_name.rsplit(".", 1)[0]
        if hf_name.endswith(".qweight"):
            q, zero, scale, g_idx = self._awq_gptq_values(module, tensor, companions)
            w = q.to(torch.float32)
            w -= zero.to(torch.float32)[:, g_idx]
            w *= scale[:, g_idx]
            return w.to(dtype)
        scale = companions.get("weight_scale_inv", companions.get("weight_scale"))
        if scale is None:
            if hf_name.endswith(".weight_packed") or tensor.dtype in (torch.float8_e4m3fn, torch.int8, torch.int32):
                raise ValueError(f"quantized weight {hf_name!r} has no weight_scale in the checkpoint")
            return tensor
        scheme = self._scheme(module)
        if hf_name.endswith(".weight_packed"):
            shape = companions.get("weight_shape")
            if shape is None:
                raise ValueError(f"packed weight {hf_name!r} has no weight_shape in the checkpoint")
            q = unpack_int32(tensor, scheme.num_bits, tuple(int(x) for x in shape.tolist()))
        else:
            q = tensor.to(torch.float32)
        out, inp = q.shape
        zero = self._zero_point(companions, scale, scheme)
        full = expand_scale(scale.to(torch.float32), out, inp, scheme.block, hf_name)
        if zero is not None and zero.numel() and bool(zero.any()):
            q = q - expand_scale(zero.to(torch.float32), out, inp, scheme.block, hf_name)
        return (q * full).to(dtype)


def unpack_int32(packed: torch.Tensor, num_bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """compressed-tensors' pack-quantized weight ([rows, words]) as float32 signed values of
    `shape` (kernels.quant_linear owns the layout)."""
    if packed.shape[0] != shape[0]:
        raise ValueError(f"packed weight of {packed.shape[0]} rows for a weight of shape {shape}")
    return unpack_signed(packed, num_bits, shape[1])


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 with 32 // bits unsigned values a word along the rows (GPTQ's qweight, lowest
    bits first) -> [R * 32 // bits, C] int16."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    per = 32 // bits
    out = torch.empty(packed.shape[0], per, packed.shape[1], dtype=torch.int16)
    for i in range(per):
        out[:, i] = (p >> (bits * i)) & ((1 << bits) - 1)
    return out.reshape(-1, packed.shape[1])


def _unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] words (int32, or int64 holding them) with 32 // bits unsigned values a word along the
    columns -> [R, C * 32 // bits] int16; `order`: the word position of each of its columns
    (AWQ's interleaving)."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    per = 32 // bits
    out = torch.empty(packed.shape[0], packed.shape[1], per, dtype=torch.int16)
    for c in range(per):
        at = c if order is None else order[c]
        out[..., c] = (p >> (bits * at)) & ((1 << bits) - 1)
    return out.reshape(packed.shape[0], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, C] signed 4-bit values -> [R, ceil(C / 8)] int32 as compressed-tensors packs them (each
    stored plus 8, lowest bits first)."""
    rows, cols = values.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int64)
    padded[:, :cols] = values.to(torch.int64) + 8
    words = (padded.view(rows, -1, 8) << torch.arange(0, 32, 4)).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def row_grid(grid: torch.Tensor, out: int, inp: int, block: tuple[int, int] | None, name: str) -> torch.Tensor:
    """A scale (or zero point) grid as one row per output row: [out, 1] per tensor or channel,
    [out, column groups] per block or group (expand_scale's checks, without the full weight)."""
    if grid.numel() == 1 or block is None:
        return expand_scale(grid, out, 1, None, name).expand(out, 1).contiguous()
    rows = grid.reshape(grid.shape[0], -1) if grid.dim() != 2 else grid
    if rows.shape != (-(-out // block[0]), -(-inp // block[1])):
        raise ValueError(f"{name}: a scale grid of {tuple(rows.shape)} does not cover a weight of ({out}, {inp}) "
                         f"in blocks of {block[0]} x {block[1]}")
    return rows.repeat_interleave(block[0], 0)[:out].contiguous()


def expand_scale(scale: torch.Tensor, out: int, inp: int, block: tuple[int, int] | None, name: str) -> torch.Tensor:
    """A scale (or zero point) grid as one value per weight: per tensor, per output channel, per
    group of input columns, or per block (the grid's cells cover `block`, the last ones cut)."""
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    grid = scale.reshape(scale.shape[0], -1) if scale.dim() != 2 else scale
    rows, cols = grid.shape
    if block is None:
        if cols != 1 or rows != out:
            raise ValueError(f"{name}: a scale of shape {tuple(scale.shape)} does not fit a weight of ({out}, {inp})")
        return grid
    bm, bn = block
    if rows != -(-out // bm) or cols != -(-inp // bn):
        raise ValueError(f"{name}: a scale grid of {tuple(grid.shape)} does not cover a weight of ({out}, {inp}) "
                         f"in blocks of {bm} x {bn}")
    return grid.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:out, :inp]
