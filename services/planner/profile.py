"""`pdserve profile`: measure step costs through the real engine and KV pulls per transport; write a profile.

Steps are run by an EngineCore of the model (its scheduler, model runner and sampler, as a
service runs them), one at a time, each timed from schedule() to the sampled tokens: prefills of
several lengths, alone and batched, chunks after a long context, decode batches of several sizes
and contexts, and decodes mixed with a prefill chunk (what a colocated instance runs). The step
cost model is fitted to all of them (services/planner/costmodel.py).

A decode batch's contexts are one computed prompt and copies of its KV, each in blocks of its own,
loaded through the engine's KV connector seam as a decode instance loads a prefill's (`ClonedKV`):
the steps measured read b distinct contexts as before, and the profile computes one prompt where it
computed b (64 x 1k tokens took two of a 12-minute profile's minutes on one slow thread).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
import statistics
import sys
import time

from engine import cpu_allocator
from engine.config import KV_CACHE_DTYPES
from engine.kv_connector import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker,
                                 KVLoad, zeroed_kv_caches)
from services.common.flags import add
from services.launcher import exit_on_signals
from services.planner.costmodel import StepPoint, fit_quality, fit_step_cost, fit_transfer_cost
from services.planner.profile_data import GPUS, LLAMA3_8B, ModelShape, Profile, roofline_profile
from services.planner.profile_serve import ServePathError

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _kv_dtype_bytes(kv_cache_dtype: str) -> int:
    """Bytes a KV value takes under --kv-cache-dtype (0: the model's dtype's; every other is 8-bit)."""
    return 0 if KV_CACHE_DTYPES[kv_cache_dtype] is None else 1


class ClonedKVScheduler(KVConnectorScheduler):
    """The profile's connector, scheduler side: a request whose `remote_kv` names blocks of this
    engine (`ClonedKV.handle`) loads its whole prompt as a copy of them into blocks of its own."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._meta = KVConnectorMetadata()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        return request.num_prompt_tokens - num_computed_tokens if request.remote_kv is not None else 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        last = -(-request.num_prompt_tokens // self.block_size)
        self._meta.loads.append(KVLoad(request.request_id, request.remote_kv, list(block_ids[first:last]), first))

    def request_finished(self, request, block_ids) -> tuple[bool, bytes | None]:
        return False, None  # a copy ends within the step that starts it: nothing is ever in flight

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta


class ClonedKVWorker(KVConnectorWorker):
    """Worker side: the engine's own zeroed caches (as without a connector); a load copies the
    source blocks' keys and values, every layer, and reports the request loaded with the step."""

    def __init__(self) -> None:
        self.kv_caches: list = []
        self._finished: list[str] = []

    def allocate_kv_caches(self, spec, num_blocks: int):
        self.kv_caches = zeroed_kv_caches(spec, num_blocks)
        return self.kv_caches

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        import torch

        for load in metadata.loads:
            src = ClonedKV.source_blocks(load.kv_handle)[load.first_block:load.first_block + len(load.block_ids)]
            if len(src) != len(load.block_ids):
                raise ValueError(f"{load.request_id}: {len(load.block_ids)} blocks to load from a source of "
                                 f"{len(src)}")
            device = self.kv_caches[0].device
            src_t = torch.tensor(src, dtype=torch.long, device=device)
            dst_t = torch.tensor(load.block_ids, dtype=torch.long, device=device)
            for cache in self.kv_caches:
                cache[:, dst_t] = cache[:, src_t]
            self._finished.append(load.request_id)

    def get_finished(self) -> KVConnectorOutput:
        done, self._finished = self._finished, []
        return KVConnectorOutput(finished_recving=done)


@dataclasses.dataclass(frozen=True)
class ClonedKV:
    """Factory of the profile's connector (engine.kv_connector.KVConnectorFactory)."""
    block_size: int

    def __call__(self) -> tuple[ClonedKVScheduler, ClonedKVWorker]:
        return ClonedKVScheduler(self.block_size), ClonedKVWorker()

    @staticmethod
    def handle(block_ids: list[int]) -> bytes:
        """What a request carries as `remote_kv` to load a copy of these blocks."""
        return b"clone:" + ",".join(map(str, block_ids)).encode()

    @staticmethod
    def source_blocks(handle: bytes) -> list[int]:
        if not handle.startswith(b"clone:"):
            raise ValueError(f"not a cloned-KV handle: {handle[:32]!r}")
        return [int(b) for b in handle[len(b"clone:"):].split(b",") if b]


class StepTimer:
    """An engine core driven step by step; each step's batch (new tokens, context) and seconds."""

    def __init__(self, model: str, device: str, num_threads: int, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int | None, dtype: str,
                 kv_steps: list[list[int]] | None = None, kv_cache_dtype: str = "auto") -> None:
        """kv_steps: the token lengths of each step's sequences (_grid_steps); the KV cache holds
        the largest step whole, in this engine's blocks, instead of the engine's default size."""
        from engine.config import EngineConfig
        from engine.engine_core import EngineCore

        config = EngineConfig.create(model, device=device, num_threads=num_threads, dtype=dtype,
                                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                     max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype)
        if kv_steps:
            blocks = _kv_blocks(kv_steps, config.cache.block_size)
            config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_blocks=blocks))
        self.config = config
        self.core = EngineCore(self.config, kv_connector_factory=ClonedKV(config.cache.block_size))
        self.vocab = self.core.vocab_size
        self._ids = itertools.count()
        self.points: list[dict] = []

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add(self, prompt_len: int, max_tokens: int, clone_of: str | None = None) -> str:
        """A request of a fresh prompt (no prefix-cache hit). clone_of: a running request whose
        prompt is computed; the new one's prompt KV is a copy of its blocks (ClonedKV), in blocks
        of its own, and it continues from its first token as a request a prefill handed over."""
        from engine.request import Request, SamplingParams

        rid = f"p{next(self._ids)}"
        n = next(self._ids)
        prompt = [(n * 7919 + i * 31) % (self.vocab - 10) + 10 for i in range(prompt_len)]
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        if clone_of is not None:
            source = self.core.scheduler.requests[clone_of]
            if source.num_computed_tokens < prompt_len:
                raise ValueError(f"{clone_of} has {source.num_computed_tokens} tokens computed: fewer than "
                                 f"the {prompt_len} to copy")
            request.remote_kv = ClonedKV.handle(self.core.scheduler.kv.get_block_ids(clone_of))
            request.append_token(prompt[-1])  # the first token, as a prefill hands it over
        self.core.add_request(request)
        return rid

    def step(self, kind: str | None) -> float:
        """One step as EngineCore.step() runs it; recorded as a point of `kind` (None: not recorded)."""
        sched, runner = self.core.scheduler, self.core.runner
        start = time.perf_counter()
        so = sched.schedule()
        # What the step computes and reads, counted off the clock and before update_from_output
        # frees a finished request's blocks.
        paused = time.perf_counter()
        chunks = [(n, r.num_computed_tokens) for r, n in zip(so.scheduled, so.num_scheduled_tokens)]
        kv_read = self._kv_read(so.scheduled, chunks) if kind is not None else 0
        start += time.perf_counter() - paused
        sched.update_from_output(so, runner.collect(runner.launch(so)))
        seconds = time.perf_counter() - start
        if kind is not None and chunks:
            self.points.append({"kind": kind, "chunks": chunks, "seconds": seconds, "kv_read": kv_read})
        return seconds

    def _kv_read(self, requests, chunks) -> int:
        """KV tokens the step reads from memory, blocks shared through the prefix cache once, as
        the cost model's KV term means (the profile's batches share none; the pairs each
        sequence computes stay in the attention terms)."""
        kv, block_size = self.core.scheduler.kv, self.config.cache.block_size
        blocks: set[int] = set()
        for r, (n, context) in zip(requests, chunks):
            blocks.update(kv.get_block_ids(r.request_id)[:-(-(context + n) // block_size)])
        return min(sum(c + n for n, c in chunks), len(blocks) * block_size)

    def check_no_preemptions(self) -> None:
        """A preempted request leaves its step smaller than the batch its point records."""
        if self.core.scheduler.num_preemptions:
            blocks = self.core.kv_cache_manager.block_pool.num_blocks
            raise RuntimeError(f"the profile's KV cache ({blocks} blocks) preempted "
                               f"{self.core.scheduler.num_preemptions} requests: its grid does not fit")

    def drain(self) -> None:
        """Abort whatever is left: the next measurement starts from an idle engine."""
        self.core.abort_requests(list(self.core.scheduler.requests))
        while self.core.has_work():
            self.step(None)

    def warm_up(self) -> None:
        self.add(64, 4)
        while self.core.has_unfinished_requests():
            self.step(None)

    def prefill(self, lengths: list[int], context: int = 0) -> None:
        """One step computing a chunk of each length after `context` tokens already computed."""
        for n in lengths:
            self.add(context + n, 1)
        for _ in range(context // self.config.scheduler.max_num_batched_tokens):
            self.step(None)  # the context, in full-budget chunks
        self.step("prefill" if context == 0 else "chunk")
        self.drain()

    def _compute_prompts(self) -> None:
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.core.scheduler.requests.values()):
            self.step(None)

    def decode(self, batch: int, context: int, steps: int, prefill_len: int = 0) -> None:
        """`steps` decode steps of `batch` sequences at `context`; with prefill_len, each also
        computes a new prompt of that many tokens (a colocated instance's mixed step)."""
        budget = self.config.scheduler.max_num_batched_tokens
        # Every sequence its own blocks, as requests are: a batch sharing one cached prompt reads
        # hot blocks (one thread, 4 x 2k tokens shared cost what 1 x 2k did) and would teach the
        # fit a price per pair that distinct contexts do not pay. One prompt is computed, the
        # others copy its KV (the values do not change what a step costs).
        max_tokens = steps + 64
        seed = self.add(context, max_tokens)
        self._compute_prompts()
        for _ in range(batch - 1):
            self.add(context, max_tokens, clone_of=seed)
        self._compute_prompts()  # one step: the seed decodes while the copies load
        for _ in range(steps):
            if prefill_len:
                self.add(min(prefill_len, budget - batch), 1)
            self.step("mixed" if prefill_len else "decode")
        self.drain()


def _grid(quick: bool, budget: int, max_len: int) -> dict:
    if quick:
        return {"prefill": [[16], [64], [budget], [budget // 4] * 2], "chunk": [(32, budget)],
                "decode": [(1, 64), (4, 128), (8, 32)], "mixed": [(2, 64, 64)], "steps": 3}
    lengths = [n for n in (16, 64, 256, 512, 1024, 1536, 2048) if n <= budget]
    # Decode batches of distinct contexts, up to 64 x 1k and 16 x 2k (64 x 2k would take two
    # minutes of prompts on one CPU thread); the KV cache is sized to hold the largest. Batch 2
    # because a CPU's step bends most between 1 and 4 (one GEMV row against a GEMM's), where a
    # few requests at a time are decoded (the decode correction interpolates between sizes).
    return {"prefill": [[n] for n in lengths] + [[256] * 4, [64] * 8, [512] * 3],
            "chunk": [(n, c) for n in (256, 1024) for c in (budget, 2 * budget) if c + n < max_len],
            "decode": [(b, c) for b in (1, 2, 4, 16, 32, 64) for c in (128, 1024, 2048)
                       if c + 128 < max_len and (c <= 1024 or b <= 16)],
            "mixed": [(b, 128, p) for b in (4, 16) for p in (256, 1024)], "steps": 6}


def _grid_steps(grid: dict) -> list[list[int]]:
    """The token lengths of the sequences alive in each measured step of the grid, at their
    longest: a decode batch's first sequence generates a token in the step its copies load, then
    every sequence runs `steps` more (and holds the next token's slot); a mixed step adds up to
    `steps` prompts; a chunk sits after its context."""
    steps = grid["steps"]
    out = [[c + steps + 2] * b for b, c in grid["decode"]]
    out += [[c + steps + 2] * b + [p + 1] * steps for b, c, p in grid["mixed"]]
    out += [[n + 1 for n in lengths] for lengths in grid["prefill"]]
    out += [[n + c + 1] for n, c in grid["chunk"]]
    return out


def _kv_blocks(steps: list[list[int]], block_size: int) -> int:
    """Blocks of `block_size` tokens that hold the largest of `steps` (each sequence's last block
    partly filled)."""
    return max(sum(-(-n // block_size) for n in seqs) for seqs in steps)


def measure_steps(timer: StepTimer, quick: bool, bar) -> list[StepPoint]:
    budget = timer.config.scheduler.max_num_batched_tokens
    g = _grid(quick, budget, timer.max_model_len)
    timer.warm_up()
    for lengths in g["prefill"]:
        for _ in range(2):
            timer.prefill([n for n in lengths if n <= budget])
        bar.update(1)
    for n, context in g["chunk"]:
        timer.prefill([n], context)
        bar.update(1)
    for batch, context in g["decode"]:
        timer.decode(batch, context, g["steps"])
        bar.update(1)
    for batch, context, prefill_len in g["mixed"]:
        timer.decode(batch, context, g["steps"], prefill_len)
        bar.update(1)
    timer.check_no_preemptions()
    return [StepPoint.of(p["chunks"], p["seconds"], kv=p["kv_read"]) for p in timer.points]


def _num_tasks(quick: bool, budget: int, max_len: int) -> int:
    g = _grid(quick, budget, max_len)
    return sum(len(g[k]) for k in ("prefill", "chunk", "decode", "mixed"))


def default_model() -> str:
    """bench-pd's random checkpoint (made on first use)."""
    from bench.pd_bench import ensure_model

    return ensure_model()


def run_profile(model: str, device: str = "cpu", num_threads: int = 1, max_num_batched_tokens: int = 2048,
                max_num_seqs: int = 256, max_model_len: int | None = None, dtype: str = "float32",
                transports: list[str] | None = None, quick: bool = False, progress: bool = True,
                serve_overhead: bool = True, router_elsewhere: bool = False,
                kv_cache_dtype: str = "auto") -> Profile:
    """serve_overhead: also time a live instance behind a router, alone and beside a busy
    neighbour instance (profile_serve.py); router_elsewhere: the fleet's router and clients run
    on other hosts, so their CPU is not charged to the instances. kv_cache_dtype: the engines'
    --kv-cache-dtype (an fp8 cache: its steps, a byte a value in every transfer and cache size)."""
    import torch
    from tqdm import tqdm

    from kvtransfer import KVLayout
    from services.planner.profile_kv import available_transports, measure_transport

    # The KV cache holds the grid's largest batch (as if every context length were allowed).
    kv_steps = _grid_steps(_grid(quick, max_num_batched_tokens, max_model_len or 1 << 30))
    timer = StepTimer(model, device, num_threads, max_num_batched_tokens, max_num_seqs, max_model_len, dtype,
                      kv_steps=kv_steps, kv_cache_dtype=kv_cache_dtype)
    hf = timer.config.model.hf_config
    shape = ModelShape.from_hf_config(hf, _DTYPE_BYTES.get(dtype, 4), _kv_dtype_bytes(kv_cache_dtype))
    block_size = timer.config.cache.block_size
    dev = str(timer.core.runner.device)
    transports = transports if transports is not None else available_transports(dev)
    block_counts = [1, 8, 32] if quick else [1, 8, 32, 64, 128]
    from services.planner.profile_serve import (BATCH, ROUNDS, SUSTAINED, ServeCost, calibrate_sustained,
                                                measure_serve_cost)
    sustained = (4,) if quick else SUSTAINED

    total = (_num_tasks(quick, max_num_batched_tokens, timer.max_model_len) + len(transports) * len(block_counts)
             + (ROUNDS + len(sustained) if serve_overhead else 0))
    with tqdm(total=total, desc="profiling", file=sys.stderr, disable=not progress) as bar:
        points = measure_steps(timer, quick, bar)
        timer.core.shutdown()
        step = fit_step_cost(points)
        serve = ServeCost(neighbour_note="not measured (--no-serve-overhead)")
        if serve_overhead:
            serve = measure_serve_cost(model, step, num_threads, dtype, timer.max_model_len, timer.vocab, dev,
                                       tick=lambda: bar.update(1), batch=4 if quick else BATCH,
                                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                       measured=points, router_elsewhere=router_elsewhere, sustained=sustained,
                                       strict=not quick, kv_cache_dtype=kv_cache_dtype)
        cache_dtype = str(timer.core.runner.kv_dtype).removeprefix("torch.")
        layout = KVLayout(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                          block_size=block_size, dtype=cache_dtype, device=dev)
        transfers, raw_transfers = {}, {}
        for t in transports:
            try:
                pts = measure_transport(t, layout, block_counts, 3 if quick else 5, tick=lambda: bar.update(1))
            except Exception as e:  # a transport unusable here: say so in the file, profile the rest
                raw_transfers[t] = {"unavailable": f"{type(e).__name__}: {e}"}
                continue
            transfers[t] = fit_transfer_cost([b for b, _ in pts], [s for _, s in pts])
            raw_transfers[t] = {"points": [[b, s] for b, s in pts]}
    machine = {"device": dev, "device_name": torch.cuda.get_device_name() if dev.startswith("cuda") else platform.processor(),
               "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
               "python": platform.python_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_avg": os.getloadavg()[0], "model_path": os.path.abspath(model), "dtype": dtype,
               "kv_cache_dtype": kv_cache_dtype,
               "allocator": os.path.basename(cpu_allocator.preloaded() or "system")}
    kinds = [p["kind"] for p in timer.points]
    quality = fit_quality(step, points)
    # Where the model is off matters: a good prefill fit does not excuse a bad decode one.
    quality["by_kind"] = {k: fit_quality(step, [p for p, pk in zip(points, kinds) if pk == k])
                          for k in sorted(set(kinds))}
    raw = {"step": {"quality": quality,
                    "points": [{**vars(p), "kind": k["kind"]} for p, k in zip(points, timer.points)]},
           "transfer": raw_transfers, "serve": {"points": serve.points, "batch_points": serve.batch_points,
                                                "router_token_s": serve.router_token_s,
                                                "neighbour_points": serve.neighbour_points,
                                                "neighbour_note": serve.neighbour_note,
                                                "sustained_runs": serve.sustained_runs,
                                                "unsettled": serve.unsettled}}
    profile = Profile(step=step, transfers=transfers, model=shape, block_size=block_size,
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      token_overhead_s=serve.token_overhead_s, step_overhead_s=serve.step_overhead_s,
                      offcore_token_s=serve.offcore_token_s, neighbour_prefill=serve.neighbour_prefill,
                      neighbour_decode=serve.neighbour_decode, machine=machine, source="measured", raw=raw)
    # What lock-step batches miss of sustained traffic, found by replaying the closed loops on
    # the profile as measured so far; it joins the per-token figure (on the instance's cores).
    extra, found = calibrate_sustained(profile, serve.sustained_runs)
    raw["serve"].update(sustained_token_s=extra, sustained_points=found)
    return dataclasses.replace(profile, token_overhead_s=profile.token_overhead_s + extra)


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure step and KV-transfer costs here; write a profile for "
                                              "`pdserve plan` and the simulator",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: bench-pd's random checkpoint)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads, as the services get (bench-pd: 1)")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPE_BYTES))
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the engines' --kv-cache-dtype: an fp8 cache's steps are measured, and its KV takes a "
                        "byte a value in the transfers and cache sizes the plan works from")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--transports", default=None, help="comma-separated (default: every one usable here)")
    p.add_argument("--out", default="profile.json")
    p.add_argument("--quick", action="store_true", help="a few points only (seconds): for tests; a rough "
                   "profile, which keeps the served path's medians where a busy machine never settles them")
    p.add_argument("--no-serve-overhead", action="store_true",
                   help="do not time a live colocated service for the serving path's cost per token")
    p.add_argument("--router-elsewhere", action="store_true",
                   help="the fleet's router and clients run on other hosts (a cluster's router pods): their CPU "
                        "per token is recorded but not charged to the instances (default: charged, as when they "
                        "share the instances' host, as in bench-pd)")
    add(p, "--cpu-allocator", default="auto", choices=cpu_allocator.CHOICES,
        help="as the services' flag: this process re-executes itself with TCMalloc preloaded on the CPU "
             "(auto, where installed), so that it measures the engine the services run; the live service "
             "it times gets the same")
    p.add_argument("--roofline", default=None, choices=sorted(GPUS),
                   help="measure nothing: write the datasheet roofline of this GPU for --model's shape "
                        "(default shape: Llama-3-8B), for planning a GPU fleet from here")
    p.set_defaults(func=run_cli)
    return p


def write_roofline(args) -> int:
    import json

    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            shape = ModelShape.from_hf_config(json.load(f), _DTYPE_BYTES[args.dtype], _kv_dtype_bytes(args.kv_cache_dtype))
    else:
        shape = dataclasses.replace(LLAMA3_8B, kv_dtype_bytes=_kv_dtype_bytes(args.kv_cache_dtype))
    prof = roofline_profile(args.roofline, shape, args.max_num_batched_tokens, args.max_num_seqs)
    prof.save(args.out)
    s = prof.step
    print(f"{args.roofline} roofline: step {s.base * 1e3:.2f} ms (weights read) flat to {s.knee_tokens} tokens, "
          f"then {s.per_token * 1e6:.1f} us/token; decode batch 64 at 2k context "
          f"{prof.step.decode_seconds(64, 2048) * 1e3:.1f} ms; wrote {args.out}")
    return 0


def _started_as_pdserve() -> bool:
    """This process is `pdserve ...` or `python -m services.cli ...`: re-executing it repeats the
    command, where inside another program (a test calling services.cli.main) it would not."""
    return os.path.basename(sys.argv[0]) == "pdserve" or sys.argv[0].endswith(os.path.join("services", "cli.py"))


def run_cli(args) -> int:
    if args.roofline:
        return write_roofline(args)
    os.environ["PDSERVE_CPU_ALLOCATOR"] = args.cpu_allocator  # the live service's, too
    if _started_as_pdserve():  # never re-execute (or take the signals of) a program that called main() (a test)
        cpu_allocator.reexec_with_allocator(args.cpu_allocator, cpu_allocator.device_type_of(args.device))
        exit_on_signals()  # SIGTERM stops the live instance and router it measures through, too
    model = args.model or default_model()
    transports = args.transports.split(",") if args.transports else None
    try:
        prof = run_profile(model, args.device, args.num_threads, args.max_num_batched_tokens, args.max_num_seqs,
                           args.max_model_len, args.dtype, transports, args.quick,
                           serve_overhead=not args.no_serve_overhead, router_elsewhere=args.router_elsewhere,
                           kv_cache_dtype=args.kv_cache_dtype)
    except ServePathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    prof.save(args.out)
    q = prof.raw["step"]["quality"]
    s = prof.step
    print(f"step = {s.base * 1e3:.2f} ms + {s.per_token * 1e6:.1f} us/token + {s.per_attn * 1e9:.2f} ns/prefill pair "
          f"+ {s.per_decode_attn * 1e9:.2f} ns/decode pair "
          f"+ {s.per_kv_token * 1e9:.1f} ns/KV token read + {s.per_seq * 1e6:.1f} us/seq "
          f"({q['num_points']} steps, median error {100 * q['median_rel_error']:.1f}%, "
          f"worst {100 * q['max_rel_error']:.1f}%)")
    for kind, kq in q["by_kind"].items():
        print(f"  {kind:<8} {kq['num_points']:>3} steps: median error {100 * kq['median_rel_error']:.1f}%, "
              f"worst {100 * kq['max_rel_error']:.1f}%")
    if s.decode_correction:
        by_batch: dict[int, list[str]] = {}
        for b, c, f in s.decode_correction:
            by_batch.setdefault(b, []).append(f"x{f:.2f} at {c:.0f}")
        print("decode steps, measured over the linear terms: "
              + "; ".join(f"batch {b} {', '.join(cells)}" for b, cells in by_batch.items()))
    if not args.no_serve_overhead:
        serve = prof.raw["serve"]
        lone = statistics.median(p["tpot_s"] - p["step_s"] for p in serve["points"])
        batched = serve["batch_points"]
        print(f"serving path: {prof.step_overhead_s * 1e3:.2f} ms a step + {prof.token_overhead_s * 1e3:.2f} ms per "
              f"sampled token (a live instance through a router over the engine's own steps: lone requests "
              f"{lone * 1e3:+.2f} ms a step, batches of {batched[0]['batch']} "
              f"{statistics.median(p['gap_s'] - p['step_s'] for p in batched) * 1e3:+.2f} ms a step"
              + (f"; of the per-token figure, {prof.offcore_token_s * 1e3:.2f} ms is the router's and "
                 f"client's CPU, which ran on cores beside the instance" if prof.offcore_token_s else
                 f"; the router's and client's CPU, {serve['router_token_s'] * 1e3:.2f} ms a token, is not "
                 f"charged (--router-elsewhere)" if serve.get("router_token_s") else "")
              + ")")
        if serve.get("unsettled"):
            print(f"serving path NOT settled: {serve['unsettled']}")
        note = prof.raw["serve"].get("neighbour_note")
        print("busy neighbour on this host: " + (note if note else
              f"prefill x{prof.neighbour_prefill:.2f}, decode x{prof.neighbour_decode:.2f}"))
    for t, c in prof.transfers.items():
        print(f"KV pull over {t}: {c.latency_s * 1e3:.2f} ms + {c.bytes_per_s / 1e9:.2f} GB/s")
    for t, d in prof.raw["transfer"].items():
        if "unavailable" in d:
            print(f"KV pull over {t}: not measured ({d['unavailable']})")
    print(f"wrote {args.out}")
    return 0
