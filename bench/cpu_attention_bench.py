"""CPU attention: pdserve's C++ decode and prefill kernels against the torch paths, same data.

Decode: the kernel against SDPA over gathered blocks.

Each layer has its own paged cache (`--blocks` blocks of 16 tokens; 8 layers of 4,096 blocks of
bench-pd's model are 1 GiB, well past any L3), and a batch's block tables are laid out as the
engine's allocator hands blocks out while sequences decode: each sequence's prompt blocks
together, then one block a sequence in turn ("in turn"), or each sequence's blocks one after
another ("contiguous"). "in cache" runs every layer over the first layer's cache, which then
stays in cache: what the kernel costs when memory is not the bound. Prints milliseconds a layer,
the K/V bytes read per second, and `cpu_decode_attention_vs_torch_speedup`: the torch path's time
over the kernel's on blocks in turn, the worst over the shapes.

Prefill: the kernel against SDPA's CPU flash kernel, one call per sequence (the path without the
extension), for steps of fresh prompts and chunks after earlier context, with bench-pd's heads
and a Llama-3-8B-like 32 / 8 heads of 128. Prints milliseconds a layer, GFLOP/s of causal
attention (the work a causal kernel must do, 4 x heads x head size x the query-key pairs) and
`cpu_prefill_attention_vs_sdpa_speedup`, the worst over the shapes.

`--kv-cache-dtype fp8` (or fp8_e5m2) stores the caches in 8 bits: both sides read the same fp8
values (the kernels widen them in place, the torch paths gather and widen them); run it beside
the default float32 to see what an fp8 cache costs or saves a layer.

    python -m bench.cpu_attention_bench [--threads 2] [--shapes 12x770,32x300,4x1024,1x2000]
        [--prefill 1024,2048,512@1536,1812+236] [--prefill-heads 8/4/64,32/8/128] [--kv-cache-dtype fp8]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.gpu_check import timed  # noqa: E402  (median after a warm-up; no sync on the CPU)
from engine.config import KV_CACHE_DTYPES  # noqa: E402
from engine.models.loader import resolve_kv_cache_dtype  # noqa: E402
from kernels import cpu_ops, torch_attention  # noqa: E402

# bench-pd's model (bench/pd_bench.py): 8 query heads, 4 KV heads of 64, 8 layers.
HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 8, 4, 64, 8, 16
PROMPT_BLOCKS = 8  # a 128-token prompt's blocks, taken together at admission


def block_tables(batch: int, context: int, in_turn: bool, first: int = 1) -> torch.Tensor:
    n = -(-context // BLOCK)
    tables = torch.zeros(batch, n, dtype=torch.int32)
    nxt = first
    if not in_turn:
        for i in range(batch):
            tables[i] = torch.arange(nxt, nxt + n, dtype=torch.int32)
            nxt += n
        return tables
    for i in range(batch):
        for j in range(min(PROMPT_BLOCKS, n)):
            tables[i, j] = nxt
            nxt += 1
    for j in range(PROMPT_BLOCKS, n):
        for i in range(batch):
            tables[i, j] = nxt
            nxt += 1
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--shapes", default="12x770,32x300,4x1024,1x2000", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--blocks", type=int, default=4096, help="blocks per layer's cache")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                    help="the caches' dtype (auto: float32, the queries')")
    ap.add_argument("--prefill", default="1024,2048,512@1536,1812+236",
                    help="prefill steps, comma-separated: sequences joined by '+', each QUERY or QUERY@CONTEXT "
                         "(a chunk after CONTEXT earlier tokens); empty: skip")
    ap.add_argument("--prefill-heads", default=f"{HEADS}/{KV_HEADS}/{HEAD_DIM},32/8/128",
                    help="HEADS/KV_HEADS/HEAD_DIM, comma-separated")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, torch.float32)
    ext = cpu_ops.load()
    if ext is None:
        print("the C++ extension did not build here (no compiler?): nothing to compare", file=sys.stderr)
        return 1
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    need = max(b * -(-c // BLOCK) for b, c in shapes) + 1
    if need > args.blocks:
        raise SystemExit(f"--blocks {args.blocks} cannot hold the largest shape's {need} blocks")
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, args.blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(args.cache_dtype)
              for _ in range(LAYERS)]
    scale = HEAD_DIM ** -0.5
    cached = str(args.cache_dtype).removeprefix("torch.")
    print(f"{LAYERS} layers x {args.blocks} blocks of {BLOCK} tokens, {HEADS} heads / {KV_HEADS} KV heads of "
          f"{HEAD_DIM}, float32 queries, {cached} cache, {args.threads} threads; median of {args.reps}")
    print(f"{'batch x context':<16}{'layout':<12}{'kernel ms':>10}{'GB/s':>7}{'torch ms':>10}{'speedup':>9}")
    worst = float("inf")
    for batch, context in shapes:
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
        lens = torch.full((batch,), context, dtype=torch.int32)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * args.cache_dtype.itemsize
        for layout in ("in turn", "contiguous", "in cache"):
            tables = block_tables(batch, context, layout != "contiguous")
            layers = caches if layout != "in cache" else caches[:1] * LAYERS
            out = torch.empty_like(q)

            def kernel():
                for cache in layers:
                    ext.paged_decode_attention(q, cache, lens, tables, scale, out)

            def reference():
                for cache in layers:
                    torch_attention._torch_decode(q, cache, lens, tables, scale, None)

            k_s = timed(kernel, args.reps) / LAYERS
            t_s = timed(reference, max(3, args.reps // 2)) / LAYERS
            want = torch_attention._torch_decode(q, layers[0], lens, tables, scale, None)
            ext.paged_decode_attention(q, layers[0], lens, tables, scale, out)
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
            if layout == "in turn":
                worst = min(worst, t_s / k_s)
            print(f"{f'{batch} x {context}':<16}{layout:<12}{k_s * 1e3:>10.3f}{kv_bytes / k_s / 1e9:>7.1f}"
                  f"{t_s * 1e3:>10.3f}{t_s / k_s:>8.1f}x")
    print(f"cpu_decode_attention_vs_torch_speedup={worst:.2f}  (worst over the shapes, blocks in turn)")
    if args.prefill:
        prefill(ext, args, g)
    return 0


def parse_step(spec: str) -> list[tuple[int, int]]:
    """"512@1536+236" -> [(512, 1536), (236, 0)]: (query tokens, earlier context) per sequence."""
    seqs = []
    for part in spec.split("+"):
        q, _, ctx = part.partition("@")
        seqs.append((int(q), int(ctx or 0)))
    return seqs


def prefill(ext, args, g: torch.Generator) -> None:
    """Prefill steps through the kernel and through SDPA, each layer on its own cache."""
    print(f"\nprefill: {LAYERS} layers, blocks of {BLOCK} tokens in a shuffled order, float32 queries, "
          f"{str(args.cache_dtype).removeprefix('torch.')} cache, {args.threads} threads; median of {args.reps}")
    print(f"{'heads':<12}{'step':<18}{'kernel ms':>10}{'GFLOP/s':>9}{'SDPA ms':>10}{'GFLOP/s':>9}{'speedup':>9}")
    worst = float("inf")
    for heads_spec in args.prefill_heads.split(","):
        heads, kv_heads, head_dim = (int(x) for x in heads_spec.split("/"))
        for step in args.prefill.split(","):
            seqs = parse_step(step)
            lens = [q + c for q, c in seqs]
            per_seq = [-(-n // BLOCK) for n in lens]
            blocks = sum(per_seq) + 1
            order = torch.randperm(blocks, generator=g).to(torch.int32)
            tables = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32)
            at = 0
            for i, n in enumerate(per_seq):
                tables[i, :n] = order[at:at + n]
                at += n
            caches = [torch.randn(2, blocks, BLOCK, kv_heads, head_dim, generator=g).to(args.cache_dtype)
                      for _ in range(LAYERS)]
            q = torch.randn(sum(q for q, _ in seqs), heads, head_dim, generator=g)
            qsl = torch.tensor([0] + [q for q, _ in seqs]).cumsum(0)
            seq_lens = torch.tensor(lens, dtype=torch.int32)
            scale = head_dim ** -0.5
            out = torch.empty_like(q)

            def kernel():
                for cache in caches:
                    ext.paged_prefill_attention(q, cache, qsl, seq_lens, tables, scale, out)

            def sdpa():
                for cache in caches:
                    torch_attention._sdpa_prefill(q, cache, qsl, seq_lens, tables, scale)

            k_s = timed(kernel, args.reps) / LAYERS
            t_s = timed(sdpa, max(3, args.reps // 2)) / LAYERS
            ext.paged_prefill_attention(q, caches[0], qsl, seq_lens, tables, scale, out)
            torch.testing.assert_close(out, torch_attention._sdpa_prefill(q, caches[0], qsl, seq_lens, tables, scale),
                                       rtol=1e-4, atol=1e-5)
            flop = sum(4 * heads * head_dim * qn * (c + (qn + 1) / 2) for qn, c in seqs)
            worst = min(worst, t_s / k_s)
            print(f"{heads_spec:<12}{step:<18}{k_s * 1e3:>10.2f}{flop / k_s / 1e9:>9.0f}{t_s * 1e3:>10.2f}"
                  f"{flop / t_s / 1e9:>9.0f}{t_s / k_s:>8.2f}x")
    print(f"cpu_prefill_attention_vs_sdpa_speedup={worst:.2f}  (worst over the shapes)")


if __name__ == "__main__":
    sys.exit(main())
