"""Mixture-of-experts MLPs of the Llama family: Mixtral, Qwen2-MoE (with a shared expert),
Qwen3-MoE, Granite-MoE and OLMoE. A router (`gate`) scores every expert per token; the token runs through
its top k, their outputs weighted by the softmax probabilities (renormalised over the k where the
model says so; Granite-MoE takes the softmax of the k logits, the same weights rounded otherwise). The experts' weights are stacked, [E, 2I, H] gate and up and [E, H, I] down, for the
backend's fused_moe (kernels.reference.fused_moe is the definition)."""
from __future__ import annotations

import torch
from torch import nn

from kernels import KernelBackend

_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "olmoe")


# transformers' defaults for what a config.json may leave out (its config classes' fields).
_DEFAULTS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1),
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      decoder_sparse_step=1),
}


def moe_fields(cfg: dict, model_type: str) -> dict:
    """LlamaArch's mixture-of-experts fields from a config.json ({} for a dense model)."""
    if model_type not in _MOE_TYPES:
        return {}
    cfg = {**_DEFAULTS[model_type], **{k: v for k, v in cfg.items() if v is not None}}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    k = cfg["num_experts_per_tok"]
    if experts < 1 or not 0 < k <= experts:
        raise ValueError(f"{model_type}: num_experts_per_tok ({k}) must be between 1 and the experts ({experts})")
    if model_type in ("mixtral", "granitemoe", "olmoe"):
        # (router_jitter_noise is training-time noise: inference routes without it, as transformers)
        inter, norm, sparse = cfg["intermediate_size"], True, tuple(range(cfg["num_hidden_layers"]))
        if model_type == "olmoe":
            norm = bool(cfg["norm_topk_prob"])
    else:
        inter, norm = cfg["moe_intermediate_size"], bool(cfg["norm_topk_prob"])
        step = cfg["decoder_sparse_step"]
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and step > 0 and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=inter, norm_topk_prob=norm,
                route_in_model_dtype=model_type != "mixtral", softmax_of_top_k=model_type == "granitemoe",
                shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"] if model_type == "qwen2_moe" else 0,
                sparse_layers=sparse)


class SparseMoE(nn.Module):
    """One layer's experts. `mlp_cls`: the dense MLP (the shared expert of Qwen2-MoE). With tp:
    every expert's (and the shared expert's) intermediate split over the ranks, the router
    replicated; the routed and the gated shared partial sums are all-reduced together, once."""

    def __init__(self, arch, kernels: KernelBackend, mlp_cls, tp=None) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp = tp
        self.top_k, self.renormalize = arch.num_experts_per_tok, arch.norm_topk_prob
        self.route_in_model_dtype = arch.route_in_model_dtype
        self.softmax_of_top_k = arch.softmax_of_top_k
        inter = arch.moe_intermediate_size if tp is None else tp.layout.local_moe_intermediate
        self.num_experts, self.intermediate_size = arch.num_experts, inter
        hidden = arch.hidden_size
        self.gate = nn.Linear(hidden, arch.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(arch.num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(arch.num_experts, hidden, inter))
        self.shared_expert = self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            shared = arch.shared_expert_intermediate_size if tp is None else tp.layout.local_shared_intermediate
            # tp None: the shared expert's partial sum is reduced with the routed one, here.
            self.shared_expert = mlp_cls(arch, kernels, None, shared)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
            if tp is not None and not tp.layout.owns_replicated_bias():  # a row-parallel bias: rank 0 adds it
                self.shared_expert.down_proj.register_parameter("bias", None)

    w13_scale = w2_scale = None  # 8-bit experts (--quantized-weights keep): float32 [E, N, groups]

    def keep_8bit(self, kind: str, groups13: int, groups2: int) -> None:
        """--quantized-weights keep, on the meta device before anything is allocated: the experts
        become FP8 or INT8 values with float32 scales per row and column group (plain tensors,
        made by `allocate`: the model's dtype cast never touches them)."""
        del self.w13, self.w2
        self.kind, self.scale_groups = kind, (groups13, groups2)
        self.w13 = self.w2 = None
        self.loaded_parts: set[str] = set()

    def allocate(self, device: torch.device) -> None:
        e, inter, hidden = self.num_experts, self.intermediate_size, self.gate.in_features
        dtype = torch.float8_e4m3fn if self.kind == "fp8" else torch.int8
        self.w13 = torch.empty(e, 2 * inter, hidden, dtype=dtype, device=device)
        self.w2 = torch.empty(e, hidden, inter, dtype=dtype, device=device)
        self.w13_scale = torch.empty(e, 2 * inter, self.scale_groups[0], dtype=torch.float32, device=device)
        self.w2_scale = torch.empty(e, hidden, self.scale_groups[1], dtype=torch.float32, device=device)

    def load_8bit(self, expert: int, stack: str, shard: int | None, q: torch.Tensor, scale: torch.Tensor,
                  name: str) -> None:
        """One expert's kept projection (quantization.KeptWeight's q and scale rows) into the stacks."""
        values, scales = (self.w13, self.w13_scale) if stack == "w13" else (self.w2, self.w2_scale)
        if expert >= self.num_experts:
            raise ValueError(f"weight {name!r}: expert {expert}, but the config has {self.num_experts} experts")
        rows, srows = values[expert], scales[expert]
        if shard is not None:
            rows, srows = rows.chunk(2)[shard], srows.chunk(2)[shard]
        if q.dtype != values.dtype or q.shape != rows.shape or scale.shape != srows.shape:
            raise ValueError(f"weight {name!r}: {tuple(q.shape)} {q.dtype} with scales {tuple(scale.shape)} does not "
                             f"fit the kept experts ({tuple(rows.shape)} {values.dtype}, scales {tuple(srows.shape)})")
        rows.copy_(q)
        srows.copy_(scale)
        self.loaded_parts.add(f"{stack}[{expert}]" + ("" if shard is None else f".{shard}"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) as transformers' routers compute them."""
        logits = self.gate(x)
        if self.softmax_of_top_k:  # Granite-MoE: the k largest float32 logits, then their softmax
            top, ids = torch.topk(logits.float(), self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(logits.dtype), ids
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if self.route_in_model_dtype else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.kernels.fused_moe(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale)
        if self.shared_expert is not None:  # sigmoid(g) * sum over ranks = sum of sigmoid(g) * each rank's part
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate_size}, "
                f"renormalize={self.renormalize}" + (f", kept={self.kind}" if self.w13_scale is not None else ""))
