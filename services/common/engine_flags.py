"""The flags every engine service takes (each also reads a PDSERVE_* environment variable)."""
from __future__ import annotations

import argparse
import json
import os

from services.common.auth import add_server_auth_flags, read_token
from engine import cpu_allocator
from engine.config import KV_CACHE_DTYPES
from engine.kv_events import KVEventsConfig
from engine.spec_decode.config import SpeculativeConfig
from services.common.flags import add
from services.common.kv_connector import KVConnectorConfig
from services.common.role import Role


def add_engine_parser(sub, role: Role, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(role.value, help=help_text, description=help_text)
    add(p, "--model", default="tiny", help="checkpoint directory, or 'tiny' (built-in random Llama)")
    add(p, "--served-model-name", default=None, help="model name in metrics (default: directory name)")
    add(p, "--host", default="127.0.0.1", help="address for gRPC and metrics")
    add(p, "--port", type=int, default=role.default_port, help="gRPC port")
    add(p, "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    add(p, "--engine-id", default=f"{role.value}-{os.getpid()}", help="instance name (default: role-pid)")
    add(p, "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    add(p, "--inproc", action="store_true", help="run the engine core in a thread, not its own process")
    add(p, "--device", default="auto", help="auto (the first visible GPU, else the CPU), cpu, cuda or cuda:N")
    add(p, "--dtype", default="auto", choices=["float32", "float16", "bfloat16", "auto"],
        help="model dtype; auto (vLLM's default): the checkpoint's own (config.json's dtype / torch_dtype)")
    add(p, "--max-model-len", type=int, default=None, help="context length (default: the model's)")
    add(p, "--block-size", type=int, default=16, help="tokens per KV block")
    add(p, "--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory-gb)")
    add(p, "--kv-cache-memory-gb", type=float, default=None,
        help="KV cache size when --num-blocks is unset (default: what --gpu-memory-utilization leaves, else 1 GiB)")
    add(p, "--gpu-memory-utilization", type=float, default=None,
        help="on a CUDA device, the share of its memory this engine takes (vLLM's flag, e.g. 0.9): what the "
             "weights and a profiled step (the longest prefill chunk, a full batch's sampling) leave of it is "
             "KV cache; not with --kv-cache-memory-gb")
    add(p, "--max-num-seqs", type=int, default=256, help="most requests in the running batch")
    add(p, "--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    add(p, "--max-waiting-requests", type=int, default=None,
        help="requests queued beyond the running batch before new ones are refused with RESOURCE_EXHAUSTED "
             "(default: 2 x --max-num-seqs)")
    add(p, "--max-waiting-tokens", type=int, default=None,
        help="prompt tokens in flight beyond the KV cache's size before new requests are refused; a prefix "
             "shared by prompts in flight counts once (default: the KV cache's size)")
    add(p, "--no-prefix-caching", action="store_true", help="disable the prefix cache")
    add(p, "--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    # vLLM's spellings of the two, so its command lines start as they are (on by default here too).
    add(p, "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="the prefix cache (vLLM's flag; on unless --no-enable-prefix-caching or --no-prefix-caching)")
    add(p, "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="chunked prefill (vLLM's flag; on unless --no-enable-chunked-prefill or --no-chunked-prefill)")
    add(p, "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="the KV cache's dtype (vLLM's flag): auto, the model's; fp8 (= fp8_e4m3) or fp8_e5m2, K and V "
             "stored in 8 bits (scale 1, or the checkpoint's calibrated k/v scales; saturating): twice the "
             "tokens in the same memory, half the bytes a transfer moves; a prefill and a decode must agree on it")
    add(p, "--quantization", default=None,
        help="the checkpoint's quantization method (vLLM's flag): read from its quantization_config when left "
             "out; served: fp8, fbgemm_fp8, compressed-tensors, awq, gptq")
    add(p, "--quantized-weights", default="dequantize", choices=["dequantize", "keep"],
        help="a quantized checkpoint's weights: dequantize (to --dtype as they load) or keep (the projections "
             "as stored: FP8 / INT8 one byte a weight, INT4 half; a fused Triton kernel with --kernel-backend "
             "triton or auto on a GPU, dequantized per call otherwise)")
    add(p, "--enable-lora", action="store_true",
        help="serve LoRA adapters (vLLM's flag): --lora-modules' PEFT checkpoints, one per request by its model "
             "name at the router, mixed with the base model in a batch (no CUDA graphs, tensor parallel size 1)")
    add(p, "--lora-modules", nargs="+", default=None,
        help="the adapters (vLLM's flag): name=path or JSON {\"name\": ..., \"path\": ...}, each a PEFT "
             "folder (adapter_config.json, adapter_model.safetensors); the environment variable "
             "whitespace-separated")
    add(p, "--max-lora-rank", type=int, default=16, help="the largest adapter rank served (vLLM's flag)")
    add(p, "--max-loras", type=int, default=None,
        help="distinct adapters among the running requests at most (vLLM's flag and rule: a request for "
             "another is passed over, keeping its place, while the rest go on), and the adapter slots on the "
             "device: allocated at start at --max-lora-rank, before the KV cache is sized; more adapters may be "
             "loaded, kept in host memory until a step runs them; default: no cap (every adapter loaded stays "
             "on the device, its memory not reserved)")
    add(p, "--max-cpu-loras", type=int, default=None,
        help="adapters kept in host memory at most, with --max-loras (vLLM's flag; >= --max-loras): the one run "
             "least recently beyond it is evicted and read back from its files when a request runs it again; "
             "default: every adapter loaded stays in host memory")
    add(p, "--stream-interval", type=int, default=1,
        help="tokens a streamed request's updates carry at least after its first, as vLLM's and SGLang's flag: "
             "fewer gRPC, router and HTTP messages per token, each update later by up to N - 1 steps")
    add(p, "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"], help="queue order")
    add(p, "--num-threads", type=int, default=None,
        help="torch threads of the engine core (per rank with --tensor-parallel-size; default there: "
             "the cores split over the ranks)")
    add(p, "--tensor-parallel-size", type=int, default=1,
        help="shard the model over N ranks: the engine core and N - 1 worker processes, one GPU each "
             "from --device on CUDA (gloo over the cores on the CPU)")
    add(p, "--kernel-backend", default="auto", choices=["auto", "torch", "reference", "triton"],
        help="attention kernels")
    add(p, "--linear-backend", default="auto", choices=["auto", "onednn", "torch"],
        help="linear layers on the CPU: onednn packs each weight once at load (auto: where oneDNN runs "
             "the dtype; a GPU always uses torch); torch keeps F.linear")
    add(p, "--cpu-allocator", default="auto", choices=cpu_allocator.CHOICES,
        help="the engine core process's malloc: auto preloads TCMalloc (libtcmalloc_minimal.so.4) for an "
             "engine on the CPU when it is installed (as vLLM's CPU backend recommends); tcmalloc insists "
             "(an error when missing); system keeps glibc's")
    add(p, "--kv-events-config", type=kv_events_config, default=None,
        help="KV cache events, as vLLM's flag: JSON with enable_kv_cache_events, publisher (zmq), endpoint "
             "(PUB bind, e.g. tcp://*:5557; port 0: any), replay_endpoint, buffer_steps, hwm, max_queue_size, "
             "topic. The router's kv_aware policy subscribes to the endpoint this instance advertises")
    add(p, "--enforce-eager", action="store_true",
        help="no CUDA graphs: every decode step runs eagerly at its own batch size")
    add(p, "--cuda-graph-sizes", type=int, nargs="+", default=None,
        help="decode batch sizes with a CUDA graph: one value N means 1, 2, 4 and every multiple of 8 up "
             "to N; several are the list (default: up to --max-num-seqs)")
    add(p, "--async-scheduling", action="store_true",
        help="schedule step n+1 while step n runs, feeding it n's sampled ids on the device")
    add(p, "--speculative-config", type=speculative_config, default=None,
        help="speculative decoding, as vLLM's flag: JSON such as {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
             "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1} or {\"method\": \"draft_model\", \"model\": DIR, "
             "\"num_speculative_tokens\": 4}. Decode and colocated engines only; not with --async-scheduling")
    add_server_auth_flags(p)
    return p


def kv_events_config(value: str) -> KVEventsConfig:
    try:
        fields = json.loads(value)
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object")
        return KVEventsConfig(**fields)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"invalid --kv-events-config {value!r}: {e}") from None


def speculative_config(value: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(value)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise argparse.ArgumentTypeError(f"invalid --speculative-config {value!r}: {e}") from None


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    """The KV connector's flags both disaggregated roles share."""
    add(p, "--kv-transport", default="tcp", choices=["tcp", "shm", "ucx", "nccl", "none"],
        help="KV transfer transport")
    add(p, "--kv-secret", default=None, help="secret shared by the deployment to sign KV handles")


def kv_connector_config(args, role: Role, **options) -> KVConnectorConfig | None:
    if args.kv_transport == "none":
        return None
    if not args.kv_secret:
        raise SystemExit(f"error: --kv-secret (or PDSERVE_KV_SECRET) is required for {role}")
    token = read_token(args.auth_token, args.auth_token_file) or b""  # it guards KV handshakes too
    return KVConnectorConfig(args.kv_transport, role, args.kv_secret.encode(), args.engine_id, auth_token=token,
                             **options)
