"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import sys

from engine.config import KV_CACHE_DTYPES
from engine.log_config import configure_logging


def _generate(args) -> int:
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.request import InvalidRequestError, SamplingParams

    async def main() -> int:
        engine = await AsyncEngine.create(args.model, device=args.device, dtype=args.dtype,
                                          max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                                          async_scheduling=args.async_scheduling,
                                          speculative_config=args.speculative_config,
                                          tensor_parallel_size=args.tensor_parallel_size,
                                          kv_cache_dtype=args.kv_cache_dtype)
        try:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                    top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                    ignore_eos=args.ignore_eos)
            print(args.prompt, end="", flush=True)
            num_tokens = 0
            async for out in engine.generate(args.prompt, params):
                print(out.delta_text, end="", flush=True)
                num_tokens += len(out.delta_token_ids)
            print(f"\n[{num_tokens} tokens, finish_reason={out.outputs[0].finish_reason}]", file=sys.stderr)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            await engine.shutdown()
        return 0

    return asyncio.run(main())


def _make_tiny(args) -> int:
    from engine.tiny import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, vocab_size=args.vocab_size, hidden_size=args.hidden,
                           intermediate_size=args.intermediate, num_layers=args.layers,
                           num_heads=args.heads, num_kv_heads=args.kv_heads,
                           max_position_embeddings=args.max_position_embeddings, seed=args.seed)
    print(f"wrote a random {args.arch} checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = p.add_subparsers(dest="command", required=True)
    add_engine_commands(sub)
    return p


def add_engine_commands(sub) -> None:
    """`generate` and `make-tiny-model`: what needs only the engine."""
    g = sub.add_parser("generate", help="generate text from a prompt with the offline engine")
    g.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny' (built-in random Llama)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", default="auto", help="auto (the first visible GPU, else the CPU), cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "auto"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: K and V stored in 8 bits")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N ranks (worker processes; on CUDA one GPU each, from --device)")
    g.add_argument("--async-scheduling", action="store_true", help="queue step n+1 while step n runs")
    g.add_argument("--speculative-config", default=None,
                   help="speculative decoding as JSON, e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
    g.set_defaults(func=_generate)

    t = sub.add_parser("make-tiny-model", help="write a tiny random HF checkpoint with a real tokenizer")
    t.add_argument("dir")
    t.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--hidden", type=int, default=64)
    t.add_argument("--intermediate", type=int, default=128)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--vocab-size", type=int, default=None, help="default: what the tokenizer learns")
    t.add_argument("--max-position-embeddings", type=int, default=2048)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_make_tiny)


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    try:
        configure_logging()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = (parser or build_parser()).parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
