"""make bench-kernels-gpu: the Triton kernels on a CUDA GPU, checked against the torch reference, then timed.

1. Checks every kernel in float16 and bfloat16 on Llama-3-8B shapes against kernels.reference
   (run on CPU), with the tests' inputs and tolerance table (tests/kernels/kernel_cases.py).
   This is the check of the native bf16 path, which the CPU interpreter cannot run.
2. Measures device-to-device copy bandwidth, then times paged decode attention (32 query
   heads, 8 KV heads, head dim 128, block size 16, bfloat16) at batch 64/256 x context
   1k/4k/16k with CUDA events: median of many runs after warm-up, rotating over several
   input sets (distinct blocks and queries) so the L2 cache does not flatter. It prints the
   achieved bandwidth (K/V/Q read + output written, over time), its ratio to the copy
   bandwidth, and the speed against torch SDPA on the same data gathered to contiguous tensors.
Target on a Hopper GPU: batch 256, context 4k at >= 0.7 of copy bandwidth.
Exit status: 1 when there is no CUDA device or a check fails; timing results never fail it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels")]

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B
TARGET_RATIO = 0.7
SWEEP = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2)]  # block_n, warps, stages


def check(name: str, fn, failures: list[str]) -> None:
    try:
        fn()
        print(f"  ok    {name}")
    except Exception as exc:  # a mismatch, or a kernel that does not compile or launch
        failures.append(name)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"  FAIL  {name}: {type(exc).__name__}: {first_line}")


def check_kernels(kernels, dtype: torch.dtype, failures: list[str]) -> None:
    """Every kernel against the reference on CPU; data movement bit-exact."""
    from kernel_cases import assert_close, assert_same, make_paged_batch, poisoned
    from kernels import reference
    from kernels.triton_decode import decode_attention

    dev, tag = torch.device("cuda"), str(dtype).removeprefix("torch.")

    def store_kv():
        cache = poisoned((2, 300, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype, "cpu")
        slots = torch.randperm(300 * BLOCK_SIZE)[:1000]
        slots[::97] = -1
        k, v = (torch.randn(1000, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2))
        got = cache.to(dev)
        kernels.store_kv(k.to(dev), v.to(dev), got, slots.to(dev))
        reference.store_kv(k, v, cache, slots)
        assert_same(got, cache)

    def attention():
        b = make_paged_batch([1, 7, 16, 33, 1, 300, 5], [1, 7, 16, 500, 4100, 300, 1000],
                             KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype)
        expected = reference.paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens,
                                             b.block_tables, b.scale)
        d = b.to(dev)
        out = poisoned(d.query.shape, dtype, dev)
        kernels.paged_attention(d.query, d.kv_cache, d.query_start_loc, d.seq_lens, d.block_tables, d.scale, out)
        assert_close(out, expected, dtype)

    def decode():
        b = make_paged_batch([1] * 6, [1, 17, 129, 1000, 4100, 16400], KV_HEADS, HEADS // KV_HEADS,
                             HEAD_DIM, BLOCK_SIZE, dtype)
        expected = reference.paged_decode_attention(b.query, b.kv_cache, b.seq_lens, b.block_tables, b.scale)
        d = b.to(dev)
        for splits in (None, 1, 7):
            out = poisoned(d.query.shape, dtype, dev)
            if splits is None:
                kernels.paged_decode_attention(d.query, d.kv_cache, d.seq_lens, d.block_tables, d.scale, out)
            else:
                decode_attention(d.query, d.kv_cache, d.seq_lens, d.block_tables, d.scale, out, splits)
            assert_close(out, expected, dtype)

    def gather_scatter():
        caches = [torch.randn(2, 200, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(4)]
        ids = torch.randperm(200)[:37]
        staging = kernels.gather_blocks([c.to(dev) for c in caches], ids.to(dev))
        assert_same(staging, reference.gather_blocks(caches, ids))
        got = [torch.zeros_like(c, device=dev) for c in caches]
        kernels.scatter_blocks(staging, got, ids.to(dev))
        want = [torch.zeros_like(c) for c in caches]
        reference.scatter_blocks(staging.cpu(), want, ids)
        for g, w in zip(got, want):
            assert_same(g, w)

    def rms_norm():
        x, res, w = torch.randn(77, 4096, dtype=dtype), torch.randn(77, 4096, dtype=dtype), torch.randn(4096, dtype=dtype)
        got = kernels.rms_norm(x.to(dev), w.to(dev), 1e-5, res.to(dev))
        for g, e in zip(got, reference.rms_norm(x, w, 1e-5, res)):
            assert_close(g, e, dtype)

    def rotary():
        q, k = torch.randn(77, HEADS, HEAD_DIM, dtype=dtype), torch.randn(77, KV_HEADS, HEAD_DIM, dtype=dtype)
        pos, cos_sin = torch.randint(0, 8192, (77,)), torch.randn(8192, HEAD_DIM)
        got = kernels.rotary_embedding(pos.to(dev), q.to(dev), k.to(dev), cos_sin.to(dev))
        for g, e in zip(got, reference.rotary_embedding(pos, q, k, cos_sin)):
            assert_close(g, e, dtype)

    for name, fn in (("store_kv", store_kv), ("paged_attention (mixed batch)", attention),
                     ("paged_decode_attention (auto, 1 and 7 splits)", decode),
                     ("gather_blocks/scatter_blocks", gather_scatter), ("rms_norm + residual", rms_norm),
                     ("rotary_embedding", rotary)):
        check(f"{name} [{tag}]", fn, failures)


def median_ms(fns: list, warmup: int = 3, iters: int = 40) -> float:
    """Median CUDA-event time of one call, cycling through fns (several input sets)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        start.record()
        fns[i % len(fns)]()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write): the roofline for the kernels."""
    src = torch.empty(2 ** 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms([lambda: dst.copy_(src)], iters=20)
    return 2 * src.numel() / (ms / 1e3)


class DecodeCase:
    """Input sets for one (batch, context): a block pool with random, disjoint block tables."""

    def __init__(self, batch: int, context: int, dtype: torch.dtype, max_sets: int = 3) -> None:
        self.batch, self.context, self.dtype = batch, context, dtype
        blocks = batch * context // BLOCK_SIZE
        block_bytes = 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * dtype.itemsize
        set_bytes = blocks * block_bytes
        budget = 0.8 * torch.cuda.mem_get_info()[0] - 1.5 * set_bytes  # room for SDPA's contiguous K/V
        self.num_sets = int(min(max_sets, budget // set_bytes))
        if self.num_sets < 1:
            return
        self.cache = torch.randn((2, self.num_sets * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=dtype, device="cuda")
        perm = torch.randperm(self.num_sets * blocks, device="cuda").to(torch.int32)
        self.block_tables = list(perm.view(self.num_sets, batch, context // BLOCK_SIZE))
        self.queries = [torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device="cuda") for _ in range(self.num_sets)]
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.out = torch.empty_like(self.queries[0])
        self.bytes = (batch * context * KV_HEADS * HEAD_DIM * 2 + 2 * batch * HEADS * HEAD_DIM) * dtype.itemsize

    def calls(self, attention) -> list:
        return [lambda i=i: attention(self.queries[i], self.cache, self.seq_lens, self.block_tables[i],
                                      HEAD_DIM ** -0.5, self.out) for i in range(self.num_sets)]

    def sdpa_ms(self) -> float | None:
        """torch SDPA (GQA) over set 0's K/V gathered into contiguous [batch, kv_heads, context, dim]."""
        f = torch.nn.functional
        ids = self.block_tables[0].long()

        def contiguous(kv: int) -> torch.Tensor:
            return self.cache[kv, ids].view(self.batch, self.context, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()

        k, v = contiguous(0), contiguous(1)
        q = self.queries[0].unsqueeze(2)  # [batch, heads, 1, dim]
        try:
            return median_ms([lambda: f.scaled_dot_product_attention(q, k, v, enable_gqa=True)])
        except (RuntimeError, TypeError) as exc:
            print(f"    sdpa unavailable: {exc}")
            return None


def time_decode(kernels, copy_bw: float, dtype: torch.dtype) -> float | None:
    """Prints one row per (batch, context); returns the ratio to copy bandwidth at the target point."""
    target = None
    print(f"\ndecode attention, {str(dtype)[6:]}, {HEADS} q heads / {KV_HEADS} kv heads, dim {HEAD_DIM}, block {BLOCK_SIZE}")
    print(f"  {'batch':>5} {'context':>7} {'sets':>4} {'triton ms':>9} {'TB/s':>6} {'of copy':>7} {'sdpa ms':>8} {'vs sdpa':>8}")
    for batch in (64, 256):
        for context in (1024, 4096, 16384):
            case = DecodeCase(batch, context, dtype)
            if case.num_sets < 1:
                print(f"  {batch:>5} {context:>7}  skipped: not enough GPU memory")
                continue
            ms = median_ms(case.calls(kernels.paged_decode_attention))
            bw = case.bytes / (ms / 1e3)
            sdpa = case.sdpa_ms()
            sdpa_cols = f"{sdpa:8.3f} {sdpa / ms:7.2f}x" if sdpa else f"{'n/a':>8} {'':>8}"
            print(f"  {batch:>5} {context:>7} {case.num_sets:>4} {ms:9.3f} {bw / 1e12:6.2f} {bw / copy_bw:7.2f} {sdpa_cols}")
            if (batch, context) == (256, 4096):
                target = bw / copy_bw
            del case
            torch.cuda.empty_cache()
    return target


def sweep_decode_tiles(copy_bw: float, dtype: torch.dtype) -> None:
    """--sweep: the decode kernel's tile/warps/stages at batch 256, context 4k, one split."""
    from kernels.triton_decode import decode_attention

    case = DecodeCase(256, 4096, dtype)
    print(f"\ndecode tile sweep, batch 256, context 4096 ({case.num_sets} sets)")
    for block_n, warps, stages in SWEEP:
        def attention(q, cache, seq_lens, tables, scale, out):
            decode_attention(q, cache, seq_lens, tables, scale, out, 1, block_n, warps, stages)
        try:
            ms = median_ms(case.calls(attention))
        except Exception as exc:  # e.g. out of shared memory for this tile
            print(f"  block_n={block_n:<4} warps={warps} stages={stages}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        print(f"  block_n={block_n:<4} warps={warps} stages={stages}: {ms:.3f} ms, "
              f"{case.bytes / (ms / 1e3) / copy_bw:.2f} of copy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time decode tile configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels_gpu.py needs a CUDA GPU and none is visible (torch.cuda.is_available() is "
              "False); nothing was checked or timed.", file=sys.stderr)
        return 1
    from kernels import triton_backend

    started = time.perf_counter()
    torch.manual_seed(0)
    kernels = triton_backend.backend()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures: list[str] = []
    print("checks against kernels.reference:")
    for dtype in (torch.float16, torch.bfloat16):
        check_kernels(kernels, dtype, failures)
    copy_bw = copy_bandwidth()
    print(f"\ndevice-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)")
    ratio = time_decode(kernels, copy_bw, torch.bfloat16)
    if args.sweep:
        sweep_decode_tiles(copy_bw, torch.bfloat16)
    if ratio is not None:
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        print(f"\ntarget (Hopper): batch 256, context 4k at >= {TARGET_RATIO} of copy bandwidth: "
              f"{ratio:.2f} -> {verdict}")
    print(f"checks: {len(failures)} failed" + (f" ({', '.join(failures)})" if failures else "")
          + f"; total {time.perf_counter() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
