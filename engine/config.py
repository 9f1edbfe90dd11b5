"""One frozen config tree, built once at the edge (CLI flags or LLM kwargs)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field

from engine import cpu_allocator
from engine.kv_events import KVEventsConfig
from engine.spec_decode.config import SpeculativeConfig

_DTYPES = ("float32", "float16", "bfloat16", "auto")
# --kv-cache-dtype's values (vLLM's names) -> the cache's torch dtype name (auto: the model's).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters an engine serves: (name, path) pairs, in --lora-modules order."""
    modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 16  # vLLM's default
    # vLLM's --max-loras: distinct adapters among the running requests at most (a request for
    # another is passed over, keeping its place), and the device's adapter slots, allocated at
    # start (the rest wait in host memory); None: no cap (every adapter loaded is on the device).
    max_loras: int | None = None
    # vLLM's --max-cpu-loras: adapters kept in host memory at most (>= max_loras; the least recently
    # run beyond it evicted, read back from its files when a step runs it again); None: every
    # adapter loaded stays in host memory.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {sorted(names)}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras is not None:
            if self.max_loras is None:
                raise ValueError("--max-cpu-loras needs --max-loras (without it every adapter loaded is in "
                                 "device memory, none in host memory)")
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras "
                                 f"({self.max_loras}) (vLLM's rule)")

    @property
    def paths(self) -> dict[str, str]:
        return dict(self.modules)


def parse_lora_modules(values) -> tuple[tuple[str, str], ...]:
    """vLLM's --lora-modules forms: `name=path`, or JSON `{"name": ..., "path": ...}`
    (`base_model_name` accepted and unused: one base model is served); a string (the flag's
    environment variable) is whitespace-separated `name=path` pairs."""
    if isinstance(values, str):
        values = values.split()
    out = []
    for value in values or ():
        if isinstance(value, (tuple, list)) and len(value) == 2:
            name, path = value
        elif isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: JSON must be an object with name and path") from None
        elif isinstance(value, str) and "=" in value:
            name, path = value.split("=", 1)
        else:
            raise ValueError(f"--lora-modules {value!r}: give name=path or a JSON object with name and path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {value!r}: the name and the path must be non-empty")
        out.append((name, path))
    return tuple(out)


@dataclass(frozen=True)
class ModelConfig:
    path: str
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs: every decode step runs eagerly at its own batch size
    # Linear layers on the CPU (kernels.cpu_linear): auto | onednn (weights packed once) | torch (F.linear).
    linear_backend: str = "auto"
    # vLLM's --quantization: None reads the checkpoint's quantization_config; a method must match it.
    quantization: str | None = None
    # A quantized checkpoint's weights: "dequantize"d to dtype as they load, or "keep" (FP8 /
    # INT8 / packed INT4 kept as stored, a fused kernel on the Triton backend: kernels.quant_linear).
    quantized_weights: str = "dequantize"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantized_weights not in ("dequantize", "keep"):
            raise ValueError(f"quantized_weights must be dequantize or keep, got {self.quantized_weights!r}")
        if self.linear_backend not in ("auto", "onednn", "torch"):
            raise ValueError(f"linear_backend must be auto, onednn or torch, got {self.linear_backend!r}")
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"model directory not found: {self.path!r}")
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise FileNotFoundError(f"{self.path!r} has no config.json: not a Hugging Face checkpoint")

    @property
    def hf_config(self) -> dict:
        with open(os.path.join(self.path, "config.json")) as f:
            config = language_model_config(json.load(f))
        if "quantization_config" not in config:  # older AutoGPTQ / AutoAWQ outputs keep it beside
            for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
                if os.path.isfile(os.path.join(self.path, name)):
                    with open(os.path.join(self.path, name)) as f:
                        config["quantization_config"] = {"quant_method": method, **json.load(f)}
                    break
        return config


# Multimodal checkpoints served as their language model (text in, text out): the architecture ->
# its language model's model type (transformers' text config of the checkpoint's config).
TEXT_OF_MULTIMODAL = {
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "Mistral3ForConditionalGeneration": "mistral",  # Mistral Small 3.1 / 3.2, Magistral Small
    "LlavaForConditionalGeneration": None,  # its text_config's own (Llama, Mistral, Qwen2, ...)
    # Qwen2-VL / 2.5-VL / 3-VL: multimodal rotary sections over (time, height, width) positions, all
    # one position for text, where it is the rotary embedding itself.
    "Qwen2VLForConditionalGeneration": "qwen2_vl_text",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl_text",
    "Qwen3VLForConditionalGeneration": "qwen3_vl_text",
}


def serves_language_model_of(config: dict) -> bool:
    """Whether a config.json is a multimodal checkpoint's, served as its language model."""
    return any(a in TEXT_OF_MULTIMODAL for a in config.get("architectures") or [])


def language_model_config(config: dict) -> dict:
    """A config.json as the engine reads it: a multimodal checkpoint's language model config
    (transformers' text config of it: a nested text_config, or Qwen2-VL's first flat form, with the
    defaults transformers fills in where published ones leave them out), the checkpoint-wide keys
    (dtype, quantization, tied embeddings) and architectures kept; any other as it is."""
    if not serves_language_model_of(config):
        return config
    from transformers import AutoConfig

    arch = next(a for a in config["architectures"] if a in TEXT_OF_MULTIMODAL)
    if "model_type" not in config:
        raise ValueError(f"{arch}: its config.json has no model_type")
    whole = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    text = whole.get_text_config()
    if text is whole:
        raise ValueError(f"{arch}: no language model config found in its config.json")
    text = text.to_dict()
    model_type = text.get("model_type")
    expected = TEXT_OF_MULTIMODAL[arch]
    if expected is not None and model_type != expected:
        raise ValueError(f"{arch}: its language model is {model_type!r}; served as {expected!r} only")
    for name in ("quantization_config", "torch_dtype", "dtype", "tie_word_embeddings"):
        if name in config and config[name] is not None:
            text[name] = config[name]
    return {**text, "model_type": model_type, "architectures": config["architectures"]}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV cache size: an explicit block count wins; else kv_cache_memory_bytes; else, on a CUDA
    # device, gpu_memory_utilization (vLLM's: that share of the device's memory, less the
    # weights and a profiled step's peak, is KV cache); else 1 GiB.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # vLLM's --kv-cache-dtype: auto (the model's dtype), or fp8 (= fp8_e4m3) / fp8_e5m2: K and V
    # stored as 8-bit floats (scale 1 or the checkpoint's k/v scales, saturating), half of a 16-bit
    # cache's bytes, read back in the model's dtype by attention. Blocks move between engines as stored.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        u = self.gpu_memory_utilization
        if u is not None and not (isinstance(u, (int, float)) and 0.0 < u <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if u is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("--kv-cache-memory-gb and --gpu-memory-utilization both size the KV cache: give one")

    @property
    def sized_by_profile(self) -> bool:
        """The KV cache is what gpu_memory_utilization leaves (no explicit size given)."""
        return self.num_blocks is None and self.gpu_memory_utilization is not None

    @property
    def fixed_kv_bytes(self) -> int:
        return self.kv_cache_memory_bytes if self.kv_cache_memory_bytes is not None else 1 << 30


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    # Admission control (the async front end): requests waiting beyond the running batch, and
    # prompt tokens in flight beyond what the KV cache holds. None: derived (2 x max_num_seqs;
    # the KV cache's size in tokens).
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    # Decode batch sizes with a CUDA graph: one value N means 1, 2, 4 and every multiple of 8 up
    # to N; several are the list; None: up to max_num_seqs.
    cuda_graph_sizes: tuple[int, ...] | None = None
    # Schedule step n+1 while step n runs, feeding it n's sampled ids on the device.
    async_scheduling: bool = False

    @property
    def decode_batch_sizes(self) -> tuple[int, ...]:
        sizes = self.cuda_graph_sizes
        if sizes is None or len(sizes) == 1:
            limit = self.max_num_seqs if sizes is None else sizes[0]
            sizes = (1, 2, 4, *range(8, limit + 1, 8))
        return tuple(sorted({s for s in sizes if s <= self.max_num_seqs}))

    def __post_init__(self) -> None:
        if self.cuda_graph_sizes is not None:
            object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))
            if not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1:
                raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if any(v is not None and v < 0 for v in (self.max_waiting_requests, self.max_waiting_tokens)):
            raise ValueError("max_waiting_requests and max_waiting_tokens must be >= 0")


@dataclass(frozen=True)
class ParallelConfig:
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: the first visible GPU, else the CPU)
    # Ranks over which one model is sharded (heads, MLP, vocabulary); rank r of a CUDA engine
    # runs on cuda:(base + r). Checked against the checkpoint's head counts at engine start.
    tensor_parallel_size: int = 1
    # The allocator of the engine core's process (engine.cpu_allocator): auto = TCMalloc on the
    # CPU where it is installed; tcmalloc; system.
    cpu_allocator: str = "auto"

    def __post_init__(self) -> None:
        if self.cpu_allocator not in cpu_allocator.CHOICES:
            raise ValueError(f"cpu_allocator must be one of {', '.join(cpu_allocator.CHOICES)}, got {self.cpu_allocator!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not re.match(r"^(auto|cpu|cuda(:\d+)?)$", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernel_backend: str = "auto"
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # vLLM's --kv-events-config
    # Tokens a streamed request's updates carry at least after its first (finishing ones aside):
    # vLLM's and SGLang's --stream-interval. 1 sends every step's token at once.
    stream_interval: int = 1
    speculative: SpeculativeConfig | None = None  # vLLM's speculative_config; None: off
    lora: LoRAConfig | None = None  # vLLM's --enable-lora / --lora-modules; None: off

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.speculative is not None and self.scheduler.async_scheduling:
            # Step n+1 is queued with one input token per row before n's accepted run is known.
            raise ValueError("speculative decoding does not combine with async scheduling: "
                             "turn one of them off")

    @classmethod
    def create(cls, model: str, **kwargs) -> "EngineConfig":
        """Flat keyword arguments (the LLM(...) / CLI surface) -> the config tree."""
        sections = {"model": ModelConfig, "cache": CacheConfig,
                    "scheduler": SchedulerConfig, "parallel": ParallelConfig}
        parts: dict[str, dict] = {name: {} for name in sections}
        top: dict = {}
        lora: dict = {}
        for key, value in kwargs.items():
            for name, section in sections.items():
                if key in {f.name for f in dataclasses.fields(section)}:
                    parts[name][key] = value
                    break
            else:
                if key in ("kernel_backend", "stream_interval"):
                    top[key] = value
                elif key == "kv_events":
                    top[key] = value if isinstance(value, KVEventsConfig) else KVEventsConfig(**(value or {}))
                elif key == "speculative_config":
                    top["speculative"] = SpeculativeConfig.parse(value)
                elif key in ("enable_lora", "lora_modules", "max_lora_rank", "max_loras", "max_cpu_loras"):
                    lora[key] = value
                else:
                    raise TypeError(f"unknown engine argument {key!r}")
        if lora.get("lora_modules") and not lora.get("enable_lora"):
            raise ValueError("--lora-modules needs --enable-lora (vLLM's rule)")
        if lora.get("enable_lora"):
            top["lora"] = LoRAConfig(parse_lora_modules(lora.get("lora_modules")),
                                     **({"max_lora_rank": lora["max_lora_rank"]} if lora.get("max_lora_rank") else {}),
                                     max_loras=lora.get("max_loras"), max_cpu_loras=lora.get("max_cpu_loras"))
        return cls(model=ModelConfig(path=model, **parts["model"]),
                   cache=CacheConfig(**parts["cache"]),
                   scheduler=SchedulerConfig(**parts["scheduler"]),
                   parallel=ParallelConfig(**parts["parallel"]), **top)
