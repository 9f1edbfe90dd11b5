"""`make bench-routing`: KV-aware routing and conditional disaggregation, through the HTTP gateway.

One prefill and two decode instances (every one publishing KV events), a router restarted per
configuration. Every configuration of a part runs the same workload (lengths, order, arrival
times) over its own token ids (bench.workloads.relabel): no run profits from another's cache,
and none draws lighter work.
(a) multi-tenant shared prefixes: 12 tenants x 20 requests, 1,024-token tenant prefixes + 64-token
    questions, tenants in random order, Poisson arrivals at 5 req/s; least_load against kv_aware (both with
    --pd-policy conditional: only kv_aware knows where a prefix is cached). TTFT p50/p90, prefix
    hit rate (cached prompt tokens / prompt tokens, from usage), throughput. Before each measured
    run, one request per tenant (its prefix and a fresh question) goes through that policy's router
    one at a time, unmeasured: the run measures routing over warm caches, as a fleet serves after
    its first minutes, not the cold start every policy shares (--cold-start: from empty caches).
(b) mixed: half the prompts of at most 64 tokens, half of 1-2k tokens; --pd-policy always vs never
    (colocated on the decodes) vs conditional, kv_aware routing; goodput at the stated SLOs (by
    default relative to the machine: twice the TTFT and 1.5x the TPOT of (b)'s longest prompt
    served alone, measured first; --goodput-b ttft:MS tpot:MS for absolute ones). Goodput is
    each policy's capacity (DistServe's goodput, bench/capacity.py): the highest Poisson rate at
    which --attainment (0.9) of a rung's requests meet both SLOs, rungs from --b-start-rate (1
    req/s) x --b-rung-factor (1.25) up while they pass and down while they fail, then
    --b-refine (1) bisection between the bracketing rungs; a rung is --b-rung-seconds (180) of
    arrivals, fresh prompts per rung, the same lengths for every policy (rungs of 60 s, 40-60
    requests against a 90% threshold, moved a rung either way on two requests: three runs gave
    0.89-1.25 on one machine; (b) takes about 35 minutes at 180 s); the policies' searches
    are interleaved, a rung of each in turn, so that the machine's drift falls on all of them.
    (Requests in SLO per second at one rate, --rate-b R, cannot separate policies that all meet
    the SLOs there: the better one's margin is at most 1 / the other's attainment.) Equal
    hardware (--b-topology equal, the default on two or more cores): always and conditional
    over the prefill (core 0) and one decode (core 1), never over two decodes (cores 0 and 1).
Prints routing_kv_aware_vs_least_load_ttft_p90_ratio and pd_conditional_vs_best_goodput_ratio,
writes JSON results and a figure under build/bench-routing (docs/routing.md has a table).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shlex
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.capacity import interleave, rung_size, search  # noqa: E402
from bench.metrics import parse_slos  # noqa: E402
from bench.procs import Proc, allowed_cpus, ensure_tiny_model, exit_on_signals, free_port, grpc_serving, http_ok, pdserve_cmd, wait_until  # noqa: E402
from bench.serve import run_benchmark  # noqa: E402
from bench.workloads import BenchRequest, relabel, shared_prefix, synthetic  # noqa: E402

BUILD = os.path.join(ROOT, "build", "bench-routing")
# Small enough for a 2-core box, large enough that a 1k-token prefill (~0.2 s) dwarfs routing.
MODEL_SHAPE = dict(arch="llama", vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=4,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=4096, initializer_range=0.02)
VOCAB = 4000  # prompt token ids below this (the model's vocabulary is 4096)
PD_ORDER = ("always", "never", "conditional")  # (b)'s policies; each one's index seeds its relabelling
KV_EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}'


def ensure_model() -> str:
    return ensure_tiny_model(os.path.join(BUILD, "model"), **MODEL_SHAPE)


class Fleet:
    """One prefill and two decode engines, kept for every configuration; a router per configuration.
    cores: each engine's CPU set (prefill, decode, decode), None: the OS places them."""

    def __init__(self, model: str, logs: str, num_blocks: int, cores: tuple = (None, None, None)) -> None:
        self.model, self.logs, self.procs = model, logs, []
        self.env = dict(os.environ, PDSERVE_KV_SECRET=secrets.token_hex(8))
        common = ["--model", model, "--num-threads", "1", "--max-model-len", "4096", "--num-blocks", str(num_blocks),
                  "--kv-transport", "tcp", "--kv-events-config", KV_EVENTS]
        self.addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        for i, (role, where) in enumerate(zip(("prefill", "decode", "decode"), cores)):
            port = free_port()
            self.procs.append(Proc(f"{role}{i}", pdserve_cmd(role, *common, "--port", str(port)), where, self.env,
                                   log_dir=logs))
            self.addresses[role].append(f"127.0.0.1:{port}")
        wait_until(lambda: all(grpc_serving(a) for v in self.addresses.values() for a in v), self.procs, "engines")
        self.router: Proc | None = None

    def start_router(self, name: str, policy: str, pd_policy: str, extra: list[str], decodes: int = 2) -> str:
        """A router over the prefill and the first `decodes` decode engines."""
        port = free_port()
        self.router = Proc(f"router-{name}", pdserve_cmd(
            "router", "--model", self.model, "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "-1",
            "--prefill", self.addresses["prefill"][0], "--decode", ",".join(self.addresses["decode"][:decodes]),
            "--policy", policy, "--pd-policy", pd_policy, *extra), env=self.env, log_dir=self.logs)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(f"{url}/health"), [self.router, *self.procs], f"router {name}")
        return url

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def stop(self) -> None:
        self.stop_router()
        for p in reversed(self.procs):
            p.stop()


def tenants_workload(num_tenants: int, per_tenant: int, prefix_len: int, question_len: int, output_len: int,
                     seed: int) -> list[BenchRequest]:
    reqs = shared_prefix(num_tenants, per_tenant, prefix_len, f"fixed:{question_len}", f"fixed:{output_len}",
                         vocab_size=VOCAB, seed=seed)
    random.Random(seed).shuffle(reqs)  # tenants arrive in random order, not in turn
    return reqs


def tenant_warm_up(requests: list[BenchRequest], prefix_len: int, seed: int) -> list[BenchRequest]:
    """One request per tenant, in order of first arrival: its prefix and a question of fresh tokens
    (no measured request's), two output tokens (a request that ends on the prefill's token never
    reaches a decode). Sent one at a time before a measured run, they put every tenant's prefix in
    a decode's cache, as a serving fleet's caches are after its first minutes."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in requests:
        prefix = tuple(r.prompt[:prefix_len])
        if prefix not in seen:
            seen.add(prefix)
            question = [rng.randrange(10, VOCAB) for _ in range(r.prompt_len - prefix_len)]
            out.append(BenchRequest(list(prefix) + question, r.prompt_len, 2))
    return out


def mixed_workload(num: int, seed: int) -> list[BenchRequest]:
    short = synthetic(num // 2, "uniform:8:64", "fixed:32", vocab_size=VOCAB, seed=seed)
    long = synthetic(num - num // 2, "uniform:1024:2048", "fixed:32", vocab_size=VOCAB, seed=seed + 1000)
    reqs = short + long
    random.Random(seed).shuffle(reqs)
    return reqs


def warm_up(fleet: Fleet) -> None:
    asyncio.run(run_benchmark(fleet.start_router("warmup", "round_robin", "always", []), None,
                              synthetic(3, "fixed:64", "fixed:4", vocab_size=VOCAB, seed=99), progress=False))
    fleet.stop_router()


def split_slos(items: list[str] | None) -> tuple[dict[str, float], dict[str, float]]:
    """(absolute SLOs in seconds, factors of the unloaded latency): 'ttft:1000' is 1 s, 'ttft:x2'
    twice the unloaded TTFT, 'tpot:x1.5' 1.5 times the unloaded TPOT (resolved by unloaded_latencies)."""
    absolute, factors = [], {}
    for item in items or []:
        key, _, value = item.partition(":")
        if not value.startswith("x"):
            absolute.append(item)
            continue
        try:
            factor = float(value[1:])
        except ValueError:
            factor = 0.0
        if key not in ("ttft", "tpot") or factor <= 0:
            raise ValueError(f"bad SLO {item!r}: a relative SLO is ttft:xF or tpot:xF with F > 0")
        factors[key] = factor
    return parse_slos(absolute), factors


def unloaded_latencies(fleet: Fleet, prompt_len: int, output_len: int, equal: bool, seed: int,
                       probes: int = 3) -> dict[str, float]:
    """TTFT and TPOT (seconds) of one prompt served alone, on (b)'s disaggregated path (always) and
    its colocated one (never), each with fresh tokens (no cache shared): per path the median of
    `probes` prompts sent one at a time (one probe moved with the machine's phase by 20%, and
    the SLOs with it), then the better path, what the machine does at best for (b)'s longest
    prompt."""
    rng = random.Random(seed)
    best = {"ttft": float("inf"), "tpot": float("inf")}
    for pd, decodes in (("always", 1 if equal else 2), ("never", 2)):
        probe = [BenchRequest([rng.randrange(10, VOCAB) for _ in range(prompt_len)], prompt_len, output_len)
                 for _ in range(probes)]
        url = fleet.start_router(f"unloaded-{pd}", "kv_aware", pd, [], decodes)
        try:
            s = asyncio.run(run_benchmark(url, None, probe, max_concurrency=1, seed=3, progress=False))
        finally:
            fleet.stop_router()
        if s["failed"]:
            raise RuntimeError(f"the unloaded probe failed on the {pd} path")
        best["ttft"] = min(best["ttft"], s["median_ttft_ms"] / 1000.0)
        best["tpot"] = min(best["tpot"], s["median_tpot_ms"] / 1000.0)
    return best


def pd_decisions(url: str) -> dict[str, float]:
    """The router's pdserve:router_pd_decisions_total counters, keyed 'decision/reason'."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return decision_counts(resp.read().decode())


def decision_counts(text: str) -> dict[str, float]:
    """pdserve:router_pd_decisions_total from a Prometheus exposition, keyed 'decision/reason'."""
    return {f"{s.labels['decision']}/{s.labels['reason']}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "pdserve:router_pd_decisions_total"}


def measured(url: str, requests, rate: float, slos, seed: int) -> dict:
    """One measured run through the router at `url`: the benchmark's summary, with the pd
    decisions the router made during it (`pd_decisions`, 'decision/reason' -> count)."""
    before = pd_decisions(url)
    s = asyncio.run(run_benchmark(url, None, requests, rate=rate, slos=slos, seed=seed, progress=False))
    after = pd_decisions(url)
    s["pd_decisions"] = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    return s


def run(fleet: Fleet, name: str, policy: str, pd_policy: str, requests, rate: float, slos, extra,
        decodes: int = 2, warm: list[BenchRequest] | None = None) -> dict:
    """One configuration's measured run through its own router; `warm` (not measured) first, one
    request at a time."""
    url = fleet.start_router(name, policy, pd_policy, extra, decodes)
    try:
        if warm:
            w = asyncio.run(run_benchmark(url, None, warm, max_concurrency=1, seed=3, progress=False))
            if w["failed"]:
                raise RuntimeError(f"{name}: {w['failed']} of {len(warm)} warm-up requests failed")
        s = measured(url, requests, rate, slos, seed=3)  # its decisions only, not the warm-up's
    finally:
        fleet.stop_router()
    s["label"] = name
    s["prefix_hit_rate"] = s["total_cached_tokens"] / max(1, s["total_input_tokens"])
    print(f"  {name:<24} TTFT p50 {s['median_ttft_ms']:8.0f} ms  p90 {s['p90_ttft_ms']:8.0f} ms  "
          f"TPOT p50 {s['median_tpot_ms']:6.1f} ms  hit rate {100 * s['prefix_hit_rate']:5.1f}%  "
          f"{s['request_throughput']:.2f} req/s  {s['output_throughput']:6.1f} tok/s  "
          f"goodput {s.get('request_goodput', 0):.3f} req/s ({100 * s.get('slo_attainment', 0):.0f}% in SLO)  "
          f"failed {s['failed']}", flush=True)
    print(f"    pd decisions: {s['pd_decisions']}", flush=True)
    return s


def shown_slos(slos: dict[str, float]) -> str:
    return " ".join(f"{k}:{1000 * v:.1f}" if k == "tpot" else f"{k}:{1000 * v:.0f}" for k, v in slos.items())


def rung_seed(k: float) -> int:
    """Rung k's workload seed (k may be a bisection's fraction, down to 1/64)."""
    return 200 + round(64 * k)


def capacity_runs(fleet: Fleet, pd_policies: list[str], equal: bool, current_slos, extra, args) -> dict[str, dict]:
    """Each pd policy's capacity (bench/capacity.py), the searches interleaved: round after
    round, every unfinished policy's next rung, each through its own router. Rung k serves
    `args.b_rung_seconds` of Poisson arrivals at b_start_rate x b_rung_factor^k, a fresh mixed
    workload (the same lengths for every policy, its own token ids), at the SLOs
    `current_slos()` gives before each round (relative ones measured then: this machine's
    unloaded TPOT moved 8.0-11.6 ms between runs, more than the policies differ). Returns per
    policy rung 0's full results (every policy ran it: the figure's) with its ladder."""
    first: dict[str, dict] = {pd: {} for pd in pd_policies}
    slos: dict[str, float] = {}

    def run_rung(pd: str, k: float) -> dict:
        rate = args.b_start_rate * args.b_rung_factor ** k
        num = rung_size(rate, args.b_rung_seconds, args.mixed_prompts)
        reqs = relabel(mixed_workload(num, seed=rung_seed(k)), 20 + PD_ORDER.index(pd), VOCAB)
        url = fleet.start_router(pd, "kv_aware", pd, extra, 2 if pd == "never" or not equal else 1)
        try:
            s = measured(url, reqs, rate, slos, seed=rung_seed(k))
        finally:
            fleet.stop_router()
        s["rate"], s["num_prompts"] = rate, num
        if k == 0:
            first[pd].update(s)
        print(f"    {pd:<12} rung {k:+.2f} {rate:6.3f} req/s x {num:>3}: {100 * s['slo_attainment']:3.0f}% in SLO  "
              f"TTFT p50 {s['median_ttft_ms']:7.0f} p90 {s['p90_ttft_ms']:7.0f} ms  TPOT p50 "
              f"{s['median_tpot_ms']:5.1f} p90 {s['p90_tpot_ms']:5.1f} ms  failed {s['failed']}  "
              f"{s['pd_decisions']}", flush=True)
        # Per request too (lengths, TTFT, inter-token gaps): which requests missed, and why.
        return {key: s[key] for key in ("rate", "num_prompts", "slo_attainment", "request_goodput", "median_ttft_ms",
                                        "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "failed", "pd_decisions",
                                        "slos_ms", "input_lens", "ttfts", "itls")}

    ladders = interleave({pd: search(args.attainment, max_up=8, max_down=8, refine=args.b_refine)
                          for pd in pd_policies}, run_rung, before_round=lambda _: slos.update(current_slos()))
    out = {}
    for pd, ladder in ladders.items():
        out[pd] = dict(first[pd], label=pd, capacity=ladder.capacity, bounded=ladder.bounded, rungs=ladder.rungs)
        print(f"  {pd:<12} capacity {'' if ladder.bounded else '>= '}{ladder.capacity:.3f} req/s", flush=True)
    return out


def pd_verdict(results: dict[str, dict]) -> str:
    """(b)'s ratio: conditional's goodput over the better of always's and never's, from each one's
    capacity where (b) searched it, else from requests in SLO per second at the one rate."""
    if all("capacity" in results[k] for k in PD_ORDER):
        best = max(("always", "never"), key=lambda k: results[k]["capacity"])
        cond, other = results["conditional"], results[best]
        ratio = cond["capacity"] / other["capacity"] if other["capacity"] > 0 else float("inf")
        caveat = [f"{k}'s capacity is only a lower bound (no rung above it failed)"
                  for k in ("conditional", best) if not results[k]["bounded"]]
        return (f"pd_conditional_vs_best_goodput_ratio={ratio:.3f}  (target >= 1.1; capacities: conditional "
                f"{cond['capacity']:.3f}, best other {best} {other['capacity']:.3f} req/s"
                + "".join(f"; {c}" for c in caveat) + ")")
    best = max(results["always"]["request_goodput"], results["never"]["request_goodput"])
    ratio = results["conditional"]["request_goodput"] / best if best > 0 else float("inf")
    return (f"pd_conditional_vs_best_goodput_ratio={ratio:.3f}  (target >= 1.1; requests in SLO per second at "
            f"one rate)")


def plot(results: dict[str, dict], out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [(names, title) for names, title in ((("least_load", "kv_aware"), "(a) multi-tenant shared prefixes"),
                                                  (("always", "never", "conditional"), "(b) mixed prompt lengths"))
              if any(name in results for name in names)]  # the parts run
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (names, title) in zip(axes[0], panels):
        for name in names:
            if name in results:
                xs = np.sort([t * 1000 for t in results[name]["ttfts"] if t > 0])
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "routing_ttft_cdf.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--per-tenant", type=int, default=20,
                    help="(a) measured requests per tenant")
    ap.add_argument("--cold-start", action="store_true",
                    help="(a) measure from empty caches: every tenant's first request is in the measured run, "
                         "and the queue their cold prefills build at the start with it (default: one request "
                         "per tenant first, not measured; p90 then measures routing in steady state)")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--rate-a", type=float, default=5.0, help="(a) requests/s, Poisson")
    ap.add_argument("--mixed-prompts", type=int, default=40,
                    help="(b) requests at --rate-b; the fewest in a capacity rung")
    ap.add_argument("--rate-b", type=float, default=None,
                    help="(b) at this one rate (requests/s, Poisson; --mixed-prompts requests): goodput as requests "
                         "in SLO per second there, instead of each policy's capacity")
    ap.add_argument("--b-start-rate", type=float, default=1.0, help="(b) capacity search: rung 0's rate, req/s")
    ap.add_argument("--b-rung-factor", type=float, default=1.25, help="(b) capacity search: rate ratio between rungs")
    ap.add_argument("--b-refine", type=int, default=1,
                    help="(b) capacity search: bisections between the last passing and the first failing rung")
    ap.add_argument("--b-rung-seconds", type=float, default=180.0,
                    help="(b) capacity search: seconds of arrivals per rung (at least --mixed-prompts requests)")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="(b) capacity search: the share of a rung's requests that must meet both SLOs")
    ap.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:100"],
                    help="(a)'s SLOs, ms: ttft:MS, tpot:MS (shown beside TTFT p90, which (a)'s ratio compares)")
    ap.add_argument("--goodput-b", nargs="*", default=["ttft:x2", "tpot:x1.5"],
                    help="(b)'s SLOs, which its goodput counts: ttft:MS / tpot:MS, or ttft:xF / tpot:xF, F times "
                         "the latency of (b)'s longest prompt (2,048 tokens) served alone on this machine (the "
                         "better of its disaggregated and colocated paths), measured before (b)'s runs: the "
                         "default, so (b) asks the same of a 2-core VM and of a GPU node")
    ap.add_argument("--num-blocks", type=int, default=600,
                    help="KV blocks of 16 tokens per engine: ~8 of the 12 tenant prefixes fit in one")
    ap.add_argument("--max-local-prefill-length", type=int, default=256)
    ap.add_argument("--max-prefill-queue-tokens", type=int, default=None,
                    help="conditional: the router's --max-prefill-queue-tokens (default: the router's)")
    ap.add_argument("--b-topology", choices=["equal", "shared"], default="equal",
                    help="(b): equal: two cores for every configuration (1 prefill + 1 decode, each pinned to a "
                         "core, against 2 decodes computing their own prompts); shared: every configuration over "
                         "the same unpinned 1 prefill + 2 decodes (three engines on two cores)")
    ap.add_argument("--router-args", default="", help="more flags for every router, as one string "
                    "(e.g. '--load-poll-interval 0.1 --kv-overlap-score-weight 2')")
    ap.add_argument("--parts", default="a,b")
    ap.add_argument("--pd-policies", default="always,never,conditional",
                    help="(b) the pd policies to run, in this order (a subset, or another order to see drift)")
    ap.add_argument("--out", default=os.path.join(BUILD, "results"))
    args = ap.parse_args(argv)
    pd_policies = args.pd_policies.split(",")
    if any(pd not in PD_ORDER for pd in pd_policies):
        ap.error(f"--pd-policies: choose from {', '.join(PD_ORDER)}")
    try:
        slos, factors_a = split_slos(args.goodput)
        slos_b, factors = split_slos(args.goodput_b)
    except ValueError as e:
        ap.error(str(e))
    if (args.b_rung_factor <= 1 or args.b_refine < 0 or args.b_rung_seconds < 0 or args.b_start_rate <= 0
            or not 0 < args.attainment <= 1 or args.mixed_prompts < 1 or (args.rate_b is not None and args.rate_b <= 0)):
        ap.error("(b): --b-rung-factor > 1, --b-refine >= 0, --b-rung-seconds >= 0, --b-start-rate > 0, "
                 "0 < --attainment <= 1, --mixed-prompts >= 1 and --rate-b > 0")
    if "b" in args.parts and not slos_b and not factors:
        ap.error("--goodput-b: (b) counts requests within its SLOs; give at least one (ttft:MS, tpot:xF, ...)")
    if factors_a:
        ap.error("--goodput: (a)'s SLOs are absolute (ttft:MS, tpot:MS); relative ones are (b)'s, --goodput-b")
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(BUILD, "logs")
    os.makedirs(logs, exist_ok=True)
    model = ensure_model()
    local = ["--max-local-prefill-length", str(args.max_local_prefill_length)]
    if args.max_prefill_queue_tokens is not None:
        local += ["--max-prefill-queue-tokens", str(args.max_prefill_queue_tokens)]
    local += shlex.split(args.router_args)
    print(f"model: random Llama {MODEL_SHAPE}, float32; 1 prefill + 2 decode engines (1 thread each, "
          f"{args.num_blocks} KV blocks of 16 tokens), every one publishing KV events", flush=True)
    results: dict[str, dict] = {}
    if "a" in args.parts:
        fleet = Fleet(model, logs, args.num_blocks)
        try:
            warm_up(fleet)
            print(f"(a) {args.tenants} tenants x {args.per_tenant} requests, {args.prefix_len}-token prefixes + "
                  f"{args.question_len}-token questions, 16 output tokens, {args.rate_a:g} req/s", flush=True)
            reqs = tenants_workload(args.tenants, args.per_tenant, args.prefix_len, args.question_len, 16, seed=10)
            print(f"    {'from empty caches (--cold-start)' if args.cold_start else 'after one unmeasured request per tenant, sent one at a time through the same router'}",
                  flush=True)
            for i, policy in enumerate(("least_load", "kv_aware")):
                mine = relabel(reqs, 10 + i, VOCAB)
                warm = None if args.cold_start else tenant_warm_up(mine, args.prefix_len, seed=30 + i)
                results[policy] = run(fleet, policy, policy, "conditional", mine, args.rate_a, slos, local, warm=warm)
        finally:
            fleet.stop()
    if "b" in args.parts:
        # Equal hardware per configuration (as bench-pd's 1P+1D against 2C): the prefill and the
        # second decode share core 0 and are never busy together; always and conditional route to
        # the prefill and the first decode (core 1), never to the two decodes.
        cpus = allowed_cpus()
        equal = args.b_topology == "equal" and len(cpus) >= 2
        a, b = (cpus * 2)[:2]
        fleet = Fleet(model, logs, args.num_blocks, ({a}, {b}, {a}) if equal else (None, None, None))
        layout = (f"always and conditional: 1 prefill (CPU {a}) + 1 decode (CPU {b}); never: 2 decodes (CPUs {a}, {b})"
                  if equal else "every configuration over 1 prefill + 2 decodes, unpinned")
        try:
            warm_up(fleet)
            probes = iter(range(1 << 30))  # fresh probe tokens every time: nothing cached

            def current_slos() -> dict[str, float]:
                """(b)'s SLOs; relative ones from the unloaded latency measured now."""
                out = dict(slos_b)
                if factors:
                    unloaded = unloaded_latencies(fleet, 2048, 32, equal, seed=40 + 1000 * next(probes))
                    out.update({k: f * unloaded[k] for k, f in factors.items()})
                    print(f"(b) unloaded, a 2,048-token prompt alone (the better path's median of 3): TTFT "
                          f"{1000 * unloaded['ttft']:.0f} ms, TPOT {1000 * unloaded['tpot']:.1f} ms; SLOs "
                          f"{shown_slos(out)}", flush=True)
                return out

            what = (f"{args.mixed_prompts} requests at {args.rate_b:g} req/s" if args.rate_b is not None else
                    f"capacity at {100 * args.attainment:.0f}% in SLO, rungs of {args.b_rung_seconds:g} s from "
                    f"{args.b_start_rate:g} req/s x{args.b_rung_factor:g}, {args.b_refine} bisection(s)"
                    + (", relative SLOs measured again before every round" if factors else ""))
            print(f"(b) half 8-64 tokens, half 1024-2048 tokens, 32 output tokens; {what}; SLOs asked "
                  f"{' '.join(args.goodput_b)}; {layout}", flush=True)
            if args.rate_b is not None:
                slos_now = current_slos()
                for pd in pd_policies:
                    reqs = relabel(mixed_workload(args.mixed_prompts, seed=20), 20 + PD_ORDER.index(pd), VOCAB)
                    results[pd] = run(fleet, pd, "kv_aware", pd, reqs, args.rate_b, slos_now, local,
                                      2 if pd == "never" or not equal else 1)
            else:
                results.update(capacity_runs(fleet, pd_policies, equal, current_slos, local, args))
        finally:
            fleet.stop()
    for name, s in results.items():
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(s, f)
    print(f"figure: {plot(results, args.out)}")
    if "least_load" in results and "kv_aware" in results:
        ratio = results["kv_aware"]["p90_ttft_ms"] / results["least_load"]["p90_ttft_ms"]
        print(f"routing_kv_aware_vs_least_load_ttft_p90_ratio={ratio:.3f}  (target <= 0.3)")
    if all(k in results for k in ("always", "never", "conditional")):
        print(pd_verdict(results))
    return 0


if __name__ == "__main__":
    exit_on_signals()  # SIGTERM stops the stack this started, too
    sys.exit(main())
