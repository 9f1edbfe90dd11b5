"""The profile file: fitted step and KV-transfer costs, the raw points, the machine and the model's shape.

Written by `pdserve profile` (measured) or by `roofline_profile` (a GPU from its datasheet);
read by the simulator, `pdserve plan` and the planner's SLA mode.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from services.planner.costmodel import StepCost, TransferCost

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int  # of the weights, and of the KV cache unless kv_dtype_bytes says otherwise
    kv_dtype_bytes: int = 0  # of the KV cache where it is not the model's dtype (--kv-cache-dtype fp8: 1)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    @property
    def num_params(self) -> int:
        """Weights of a Llama-shaped decoder (embeddings and LM head untied)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
        return self.num_layers * per_layer + 2 * self.vocab_size * h

    @classmethod
    def from_hf_config(cls, hf: dict, dtype_bytes: int, kv_dtype_bytes: int = 0) -> "ModelShape":
        heads = hf["num_attention_heads"]
        return cls(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf["intermediate_size"], num_heads=heads,
                   num_kv_heads=hf.get("num_key_value_heads") or heads,
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                   vocab_size=hf["vocab_size"], dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_dtype_bytes)


@dataclass(frozen=True)
class Profile:
    """What one instance costs: a step of any batch, a KV pull per transport, and the fixed
    overheads of a request's path around the engines."""
    step: StepCost
    transfers: dict[str, TransferCost]
    model: ModelShape
    block_size: int = 16
    # The engine settings the steps were measured (and are simulated) with.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # Client -> router -> engine and back, added to every TTFT; and the router's hop from the
    # prefill's answer to the decode's stream (P/D only).
    request_overhead_s: float = 0.0
    pd_hop_s: float = 0.0
    # The serving path's time per sampled token on the instance's cores (the engine core's
    # outputs, the engine host, its gRPC stream; on a CPU host also the router's and client's
    # CPU), measured through a live service (profile_serve): lock-step batches, plus what
    # sustained traffic costs beyond them (raw["serve"]["sustained_token_s"], from closed loops).
    token_overhead_s: float = 0.0
    # Of token_overhead_s: the router's and client's CPU a token, measured on cores beside the
    # instance (profile_serve.charge_router_cpu). The simulator charges it to a step only when no
    # core of the host is free to run it.
    offcore_token_s: float = 0.0
    # ... and per step that samples (the engine core's one output message a step, its host's
    # loop), fitted with the above from lone requests and a batch's (profile_serve).
    step_overhead_s: float = 0.0
    # Step time while another instance on the same host is busy, over alone: for a step with a
    # prefill chunk and for a decode-only step (a measured CPU profile; 1.0 = nothing shared).
    neighbour_prefill: float = 1.0
    neighbour_decode: float = 1.0
    machine: dict = field(default_factory=dict)
    source: str = "measured"
    raw: dict = field(default_factory=dict)  # the measured points and fit quality, kept as written

    def __post_init__(self) -> None:
        if self.token_overhead_s < 0 or self.step_overhead_s < 0:
            raise ValueError(f"serving-path overheads must be >= 0, got {self.step_overhead_s} s a step and "
                             f"{self.token_overhead_s} s a token")
        if not 0 <= self.offcore_token_s <= self.token_overhead_s:
            raise ValueError(f"the off-core share of the per-token overhead ({self.offcore_token_s} s) must be "
                             f"between 0 and the per-token overhead ({self.token_overhead_s} s)")
        if not (self.neighbour_prefill > 0 and self.neighbour_decode > 0):
            raise ValueError(f"neighbour slowdown factors must be > 0, got prefill {self.neighbour_prefill}, "
                             f"decode {self.neighbour_decode}")

    @property
    def width(self) -> int:
        """Units one instance of this profile occupies: a CPU profile's torch threads (cores), else 1 GPU."""
        if str(self.machine.get("device", "")).startswith("cpu"):
            return max(1, int(self.machine.get("threads", 1)))
        return 1

    @property
    def instances_per_host(self) -> int:
        """Instances that share one machine as the profiled one (and slow each other by the
        neighbour factors): its cores over a CPU instance's width; 1 elsewhere."""
        if str(self.machine.get("device", "")).startswith("cpu"):
            return max(1, int(self.machine.get("cpu_count") or self.width) // self.width)
        return 1

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes a pull moves for a prompt: whole blocks."""
        blocks = math.ceil(num_tokens / self.block_size)
        return blocks * self.block_size * self.model.kv_bytes_per_token

    def transfer(self, transport: str) -> TransferCost:
        if transport not in self.transfers:
            raise ValueError(f"the profile has no {transport!r} transfer measurements "
                             f"(it has: {', '.join(sorted(self.transfers)) or 'none'})")
        return self.transfers[transport]

    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, "source": self.source, "machine": self.machine,
                "model": asdict(self.model), "block_size": self.block_size,
                "engine": {"max_num_batched_tokens": self.max_num_batched_tokens,
                           "max_num_seqs": self.max_num_seqs},
                "overhead": {"request_s": self.request_overhead_s, "pd_hop_s": self.pd_hop_s,
                             "token_s": self.token_overhead_s, "step_s": self.step_overhead_s,
                             "token_points": self.raw.get("serve", {}).get("points", []),
                             "batch_points": self.raw.get("serve", {}).get("batch_points", []),
                             "offcore_token_s": self.offcore_token_s,
                             "router_token_s": self.raw.get("serve", {}).get("router_token_s", 0.0),
                             "unsettled": self.raw.get("serve", {}).get("unsettled", ""),
                             "sustained": {"token_s": self.raw.get("serve", {}).get("sustained_token_s", 0.0),
                                           "points": self.raw.get("serve", {}).get("sustained_points", []),
                                           "runs": self.raw.get("serve", {}).get("sustained_runs", [])},
                             "neighbour": {"prefill": self.neighbour_prefill, "decode": self.neighbour_decode,
                                           "points": self.raw.get("serve", {}).get("neighbour_points", []),
                                           "note": self.raw.get("serve", {}).get("neighbour_note", "")}},
                "step": {"fit": asdict(self.step), **self.raw.get("step", {})},
                "transfer": {t: {"fit": asdict(c), **self.raw.get("transfer", {}).get(t, {})}
                             for t, c in self.transfers.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"profile format version {data.get('version')!r} is not {FORMAT_VERSION}")
        try:
            step = data["step"]
            transfers = data.get("transfer", {})
            overhead = data.get("overhead", {})
            neighbour = overhead.get("neighbour", {})
            sustained = overhead.get("sustained", {})
            raw = {"serve": {"points": overhead.get("token_points", []),
                             "sustained_token_s": sustained.get("token_s", 0.0),
                             "sustained_points": sustained.get("points", []),
                             "sustained_runs": sustained.get("runs", []),
                             "batch_points": overhead.get("batch_points", []),
                             "router_token_s": overhead.get("router_token_s", 0.0),
                             "unsettled": overhead.get("unsettled", ""),
                             "neighbour_points": neighbour.get("points", []), "neighbour_note": neighbour.get("note", "")},
                   "step": {k: v for k, v in step.items() if k != "fit"},
                   "transfer": {t: {k: v for k, v in d.items() if k != "fit"} for t, d in transfers.items()}}
            return cls(step=StepCost(**step["fit"]),
                       transfers={t: TransferCost(**d["fit"]) for t, d in transfers.items()},
                       model=ModelShape(**data["model"]), block_size=data.get("block_size", 16),
                       max_num_batched_tokens=data["engine"]["max_num_batched_tokens"],
                       max_num_seqs=data["engine"]["max_num_seqs"],
                       request_overhead_s=data.get("overhead", {}).get("request_s", 0.0),
                       pd_hop_s=data.get("overhead", {}).get("pd_hop_s", 0.0),
                       token_overhead_s=overhead.get("token_s", 0.0),
                       step_overhead_s=overhead.get("step_s", 0.0),
                       offcore_token_s=overhead.get("offcore_token_s", 0.0),
                       neighbour_prefill=neighbour.get("prefill", 1.0), neighbour_decode=neighbour.get("decode", 1.0),
                       machine=data.get("machine", {}), source=data.get("source", "measured"), raw=raw)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a pdserve profile: {type(e).__name__}: {e}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            return cls.from_json(json.load(f))


# Datasheet numbers (dense BF16 tensor TFLOPS, HBM bytes/s): NVIDIA H100 SXM and H200 SXM
# datasheets (nvidia.com/en-us/data-center/h100/, /h200/). NVLink 4: 450 GB/s each way.
GPUS = {"h100": {"flops": 989e12, "hbm_bytes_per_s": 3.35e12, "nvlink_bytes_per_s": 450e9},
        "h200": {"flops": 989e12, "hbm_bytes_per_s": 4.8e12, "nvlink_bytes_per_s": 450e9}}
# Fractions of peak a serving engine reaches; see docs/planning.md for where they come from.
MFU, MBU, LINK_EFFICIENCY = 0.5, 0.7, 0.7
STEP_OVERHEAD_S = 2e-3  # scheduling, sampling and launch per step (CUDA graphs for decodes)


def roofline_profile(gpu: str, model: ModelShape, max_num_batched_tokens: int = 8192,
                     max_num_seqs: int = 256) -> Profile:
    """A profile for a GPU never measured here: the roofline of its datasheet at the efficiencies
    above. A step reads every weight once (flat up to the knee, where compute takes over), then
    pays 2 x params FLOPs per token; attention compute per query-key pair, the KV cache read per
    context token."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; choose one of {', '.join(GPUS)}")
    g = GPUS[gpu]
    flops, bw = g["flops"] * MFU, g["hbm_bytes_per_s"] * MBU
    weight_s = model.num_params * model.dtype_bytes / bw
    per_token = 2 * model.num_params / flops
    per_pair = 4 * model.num_layers * model.num_heads * model.head_dim / flops
    step = StepCost(base=STEP_OVERHEAD_S + weight_s, per_token=per_token,
                    per_attn=per_pair, per_decode_attn=per_pair,  # the same FLOPs; a decode's read is per_kv_token
                    per_kv_token=model.kv_bytes_per_token / bw, per_seq=20e-6,
                    knee_tokens=int(weight_s / per_token))
    link = TransferCost(latency_s=1e-3, bytes_per_s=g["nvlink_bytes_per_s"] * LINK_EFFICIENCY)
    return Profile(step=step, transfers={"nccl": link, "ucx": link}, model=model,
                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                   machine={"device": gpu, "from": "datasheet roofline"}, source=f"roofline:{gpu}")


LLAMA3_8B = ModelShape(num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                       num_kv_heads=8, head_dim=128, vocab_size=128256, dtype_bytes=2)
