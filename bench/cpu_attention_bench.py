"""CPU decode attention: pdserve's C++ kernel against the torch path (SDPA over gathered blocks), same data.

Each layer has its own paged cache (`--blocks` blocks of 16 tokens; 8 layers of 4,096 blocks of
bench-pd's model are 1 GiB, well past any L3), and a batch's block tables are laid out as the
engine's allocator hands blocks out while sequences decode: each sequence's prompt blocks
together, then one block a sequence in turn ("in turn"), or each sequence's blocks one after
another ("contiguous"). "in cache" runs every layer over the first layer's cache, which then
stays in cache: what the kernel costs when memory is not the bound. Prints milliseconds a layer,
the K/V bytes read per second, and `cpu_decode_attention_vs_torch_speedup`: the torch path's time
over the kernel's on blocks in turn, the worst over the shapes.

    python -m bench.cpu_attention_bench [--threads 2] [--shapes 12x770,32x300,4x1024,1x2000]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.gpu_check import timed  # noqa: E402  (median after a warm-up; no sync on the CPU)
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
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ext = cpu_ops.load()
    if ext is None:
        print("the C++ extension did not build here (no compiler?): nothing to compare", file=sys.stderr)
        return 1
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    need = max(b * -(-c // BLOCK) for b, c in shapes) + 1
    if need > args.blocks:
        raise SystemExit(f"--blocks {args.blocks} cannot hold the largest shape's {need} blocks")
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, args.blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    scale = HEAD_DIM ** -0.5
    print(f"{LAYERS} layers x {args.blocks} blocks of {BLOCK} tokens, {HEADS} heads / {KV_HEADS} KV heads of "
          f"{HEAD_DIM}, float32, {args.threads} threads; median of {args.reps}")
    print(f"{'batch x context':<16}{'layout':<12}{'kernel ms':>10}{'GB/s':>7}{'torch ms':>10}{'speedup':>9}")
    worst = float("inf")
    for batch, context in shapes:
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
        lens = torch.full((batch,), context, dtype=torch.int32)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 4
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
