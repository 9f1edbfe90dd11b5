"""Which slice of each weight, head and vocabulary row a tensor-parallel rank owns (Megatron's
column/row split, vLLM's replicated KV heads when ranks outnumber them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def check_tensor_parallel_size(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                               moe_intermediate_size: int = 0, shared_expert_intermediate_size: int = 0) -> None:
    """A clear ValueError, naming the numbers, for a size the checkpoint cannot be split by."""
    if size == 1:
        return
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and the model's {num_kv_heads} KV heads: one must divide "
                         f"the other (KV heads are split over ranks, or each replicated over size / KV heads ranks)")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's MLP intermediate size "
                         f"{intermediate_size}")
    if moe_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's expert intermediate size "
                         f"{moe_intermediate_size}")
    if shared_expert_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's shared expert intermediate size "
                         f"{shared_expert_intermediate_size}")


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    # A mixture of experts: every expert's MLP is split as a dense one (gate and up by rows, down
    # by columns, one all-reduce a layer); the router is replicated.
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def of(cls, arch, size: int, rank: int) -> "TPLayout":
        moe, shared = getattr(arch, "moe_intermediate_size", 0), getattr(arch, "shared_expert_intermediate_size", 0)
        check_tensor_parallel_size(size, arch.num_heads, arch.num_kv_heads, arch.intermediate_size, moe, shared)
        return cls(rank, size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size,
                   arch.vocab_size, moe, shared)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        # Replicated (size > KV heads): size // kv consecutive ranks share one KV head, which is
        # the head their query heads group onto.
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        return self.rank // (self.size // self.num_kv_heads)

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def local_moe_intermediate(self) -> int:
        return self.moe_intermediate_size // self.size

    @property
    def local_shared_intermediate(self) -> int:
        return self.shared_expert_intermediate_size // self.size

    def _mlp_width(self, name: str) -> int:
        """The rank's intermediate width of the MLP weight `name` belongs to."""
        if ".experts." in name:
            return self.local_moe_intermediate
        if ".shared_expert." in name:
            return self.local_shared_intermediate
        return self.local_intermediate

    @property
    def vocab_per_rank(self) -> int:
        """Rows of every rank's embedding and LM head shard (the last is zero-padded to this)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_size, self.vocab_start + self.vocab_per_rank)

    def owns_replicated_bias(self) -> bool:
        """A row-parallel layer's bias is added once, by rank 0, before the all-reduce."""
        return self.rank == 0

    def split_of(self, name: str) -> tuple[int, int, int] | None:
        """How this rank holds projection weight (or bias) `name` of one expert or layer: (0, start,
        end), its rows (column parallel: q, k, v, gate, up); (1, start, end), its columns (row
        parallel: o, down; a bias of these is whole, on rank 0); None: replicated or not a projection."""
        hd = self.head_dim
        if ".q_proj." in name:
            return 0, self.rank * self.local_heads * hd, (self.rank + 1) * self.local_heads * hd
        if ".k_proj." in name or ".v_proj." in name:
            return 0, self.kv_head_start * hd, (self.kv_head_start + self.local_kv_heads) * hd
        if any(f".{p}." in name for p in ("gate_proj", "up_proj", "w1", "w3")):  # w1, w3: Mixtral's experts
            w = self._mlp_width(name)
            return 0, self.rank * w, (self.rank + 1) * w
        if any(f".{p}." in name for p in ("o_proj", "down_proj", "w2")):
            width = self.local_heads * hd if ".o_proj." in name else self._mlp_width(name)
            return 1, self.rank * width, (self.rank + 1) * width
        return None

    def read(self, name: str, tensor_slice) -> torch.Tensor | None:
        """The rank's part of HF weight `name`, read through a safetensors slice (so other ranks'
        rows never leave the file) or cut from a whole tensor (a dequantized one); None: this rank
        holds nothing of it."""
        if ".experts." in name and name.endswith((".gate_up_proj", ".down_proj")):  # stacked experts, whole
            w = self.local_moe_intermediate
            if name.endswith(".down_proj"):  # [E, H, I]
                return tensor_slice[:, :, self.rank * w:(self.rank + 1) * w]
            whole = self.moe_intermediate_size  # [E, 2I, H]: this rank's gate rows and its up rows
            return torch.cat([tensor_slice[:, self.rank * w:(self.rank + 1) * w],
                              tensor_slice[:, whole + self.rank * w:whole + (self.rank + 1) * w]], dim=1)
        if name.endswith(("embed_tokens.weight", "lm_head.weight", "lm_head.bias")):  # (Phi's head has a bias)
            part = tensor_slice[self.vocab_start:self.vocab_end]
            pad = self.vocab_per_rank - part.shape[0]
            return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            shape = tensor_slice.get_shape() if hasattr(tensor_slice, "get_shape") else tensor_slice.shape
            if len(shape) == 2:  # a weight per head, [heads, head_dim] (Command R+): this rank's heads' rows
                _, start, end = self.split_of(name.replace("_norm.", "_proj."))
                return tensor_slice[start // self.head_dim:end // self.head_dim]
            if shape[0] != self.head_dim:  # over all heads at once (OLMo 2): this rank's heads' slice
                _, start, end = self.split_of(name.replace("_norm.", "_proj."))
                return tensor_slice[start:end]
        split = self.split_of(name)
        if split is not None and split[0] == 1 and name.endswith(".bias"):
            return tensor_slice[:] if self.owns_replicated_bias() else None
        if split is not None:
            dim, start, end = split
            return tensor_slice[start:end] if dim == 0 else tensor_slice[:, start:end]
        # norms (and a scalar: xIELU's beta, eps): replicated
        shape = tensor_slice.get_shape() if hasattr(tensor_slice, "get_shape") else tensor_slice.shape
        return tensor_slice[:] if len(shape) else tensor_slice[...]
