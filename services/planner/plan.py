"""`pdserve plan`: simulate every fleet of N instances (each P:D split, all colocated) on a workload; pick the best.

A fleet's capacity is the highest arrival rate (the workload's requests, arriving faster or slower)
at which the simulator still sees `attainment` of the requests meet both SLOs, as DistServe
defines per-GPU goodput; the winner has the most capacity per unit (a GPU, or a core of a CPU
profile). The table also shows each fleet at the workload's own rate.

Several profiles of one model at different instance widths (CPU threads; as Dynamo's profiler
sweeps tensor-parallel sizes) are planned together: N units make N / width instances of each.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

from services.planner.profile_data import Profile
from services.planner.sim_metrics import parse_slo, summarize
from services.planner.simulator import Fleet, simulate
from services.planner import workload as workloads
from services.planner.workload import Workload

FACTOR_LIMIT = 1024.0  # rates searched within the workload's rate / and x this
BISECTIONS = 7  # capacity to within ~1% (2^(1/2^7) on a log scale after bracketing by doubling)
# Requests per simulated rate: enough that a fleet above its capacity builds a queue that shows,
MIN_REQUESTS = 300
# ... and arriving over this many request lives at the SLOs' edge (TTFT + mean OSL x TPOT): a
# window shorter than a life is a burst the batch absorbs (a 1:10 shape's 300 requests at a loose
# SLO arrive in 0.15 s at 2,000 req/s, and two one-core instances "carried" that). Two lives: the
# first fills the fleet to its steady state, the second shows whether it holds there.
LIVES = 2.0
MAX_REQUESTS = 50_000  # the window's cap (a 64-GPU fleet at thousands of req/s); MIN_REQUESTS still holds


@dataclass(frozen=True)
class FleetResult:
    fleet: Fleet
    at_rate: dict  # the summary at the workload's own rate
    capacity_rps: float  # highest rate meeting the attainment target (0: not even at rate / limit)
    width: int = 1  # units (cores of a CPU profile, GPUs) one instance occupies

    @property
    def units(self) -> int:
        return self.fleet.num_instances * self.width

    @property
    def capacity_per_unit(self) -> float:
        """Per unit (a GPU, a core): a 2-core instance counts twice."""
        return self.capacity_rps / self.units

    @property
    def name(self) -> str:
        return self.fleet.name if self.width == 1 else f"{self.fleet.name}x{self.width}"


def fleets_of(n: int, transport: str = "tcp") -> list[Fleet]:
    """Every P:D split of n instances (1..n-1 prefills), then n colocated."""
    if n < 1:
        raise ValueError("a fleet needs at least one instance")
    return [Fleet(num_prefill=p, num_decode=n - p, transport=transport) for p in range(1, n)] + [
        Fleet(num_colocated=n)]


def attainment(profile: Profile, fleet: Fleet, workload: Workload, slos: dict[str, float]) -> float:
    return summarize(simulate(profile, fleet, list(workload.requests)), slos)["slo_attainment"]


def window_seconds(workload: Workload, slos: dict[str, float], lives: float = LIVES) -> float:
    """Seconds of arrivals a capacity test spans: `lives` lives of a mean request at the SLOs' edge."""
    return lives * (slos.get("ttft", 0.0) + workload.mean_osl * slos.get("tpot", 0.0))


def search_workload(workload: Workload, factor: float, slos: dict[str, float]) -> Workload:
    """The workload `factor` times as fast, as the capacity search simulates it: at least
    MIN_REQUESTS, arriving over at least window_seconds (capped at MAX_REQUESTS)."""
    return workload.scaled(factor, MIN_REQUESTS, window_seconds(workload, slos), MAX_REQUESTS)


def capacity(profile: Profile, fleet: Fleet, workload: Workload, slos: dict[str, float], target: float) -> float:
    """The highest rate (req/s) at which `target` of the requests meet the SLOs, each rate
    simulated as search_workload() sizes it. The search doubles up from the workload's rate to the first
    rate that fails and bisects below it, so a fleet that held a higher rate by absorbing a burst
    does not lift the result past a rate it failed."""
    if not 0 < workload.rate < math.inf:
        raise ValueError("the workload needs requests arriving at different times: its rate is what is scaled")
    ok = lambda f: attainment(profile, fleet, search_workload(workload, f, slos), slos) >= target  # noqa: E731
    hi = 1.0
    if ok(1.0):
        while hi < FACTOR_LIMIT and ok(hi * 2):
            hi *= 2
        lo, hi = hi, hi * 2
        if lo >= FACTOR_LIMIT:
            return workload.rate * lo
    else:
        while True:
            if hi <= 1 / FACTOR_LIMIT:
                return 0.0
            lo = hi / 2
            if ok(lo):
                break
            hi = lo
    for _ in range(BISECTIONS):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return workload.rate * lo


def evaluate(profile: Profile, fleet: Fleet, workload: Workload, slos: dict[str, float],
             target: float = 0.9) -> FleetResult:
    at_rate = summarize(simulate(profile, fleet, list(workload.requests)), slos)
    return FleetResult(fleet, at_rate, capacity(profile, fleet, workload, slos, target))


def choose(results: list[FleetResult], rate: float) -> FleetResult:
    """Most capacity per instance among the fleets that carry `rate`; if none does, among all."""
    enough = [r for r in results if r.capacity_rps >= rate] or results
    return max(enough, key=lambda r: (r.capacity_per_unit, r.at_rate["slo_attainment"], -r.units))


def table(results: list[FleetResult], rate: float) -> str:
    head = (f"{'fleet':<9}{'capacity':>10}{'per unit':>10}{'goodput':>9}{'in SLO':>8}{'TTFT p90':>10}"
            f"{'TPOT p90':>10}{'ITL p99':>9}{'max stall':>11}")
    lines = [f"{'':<9}{'req/s':>10}{'req/s':>10}{'@' + format(rate, '.3g'):>9}{'':>8}{'ms':>10}{'ms':>10}"
             f"{'ms':>9}{'ms':>11}", head]
    for r in results:
        s = r.at_rate
        lines.append(f"{r.name:<9}{r.capacity_rps:>10.3f}{r.capacity_per_unit:>10.3f}"
                     f"{s['request_goodput']:>9.3f}{100 * s['slo_attainment']:>7.0f}%{s['p90_ttft_ms']:>10.0f}"
                     f"{s['p90_tpot_ms']:>10.1f}{s['p99_itl_ms']:>9.1f}{s['max_itl_ms']:>11.0f}")
    return "\n".join(lines)


EXHAUSTIVE_UP_TO = 8  # fleet sizes whose every split is simulated; above, the best split is searched


def best_splits(profile: Profile, n: int, workload: Workload, slos: dict[str, float], target: float,
                transport: str) -> list[FleetResult]:
    """The P:D splits of n a ternary search over the prefill count visits (about 2 log n of them),
    assuming capacity rises then falls with it (one pool is the bottleneck, then the other)."""
    seen: dict[int, FleetResult] = {}

    def at(p: int) -> FleetResult:
        if p not in seen:
            seen[p] = evaluate(profile, Fleet(num_prefill=p, num_decode=n - p, transport=transport),
                               workload, slos, target)
        return seen[p]

    def key(p: int):
        return at(p).capacity_rps, at(p).at_rate["slo_attainment"]

    lo, hi = 1, n - 1
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if key(m1) < key(m2):
            lo = m1 + 1
        else:
            hi = m2 - 1 if key(m1) > key(m2) else m2
    for p in range(lo, hi + 1):
        at(p)
    return [seen[p] for p in sorted(seen)]


def plan(profile: Profile, workload: Workload, slos: dict[str, float], instances: list[int],
         transport: str, target: float = 0.9, exhaustive_up_to: int = EXHAUSTIVE_UP_TO
         ) -> tuple[list[FleetResult], FleetResult]:
    results = []
    for n in instances:
        if n <= exhaustive_up_to:
            results += [evaluate(profile, f, workload, slos, target) for f in fleets_of(n, transport)]
        else:
            results += best_splits(profile, n, workload, slos, target, transport)
            results.append(evaluate(profile, Fleet(num_colocated=n), workload, slos, target))
    return results, choose(results, workload.rate)


def plan_widths(profiles: list[Profile], workload: Workload, slos: dict[str, float], units: list[int],
                transport: str, target: float = 0.9, exhaustive_up_to: int = EXHAUSTIVE_UP_TO
                ) -> tuple[list[FleetResult], FleetResult]:
    """plan() for each profile's instance width: N units are N // width instances of it (sizes a
    width does not divide, or fewer units than one instance, are skipped for that width)."""
    results = []
    for prof in profiles:
        w = prof.width
        sizes = [n // w for n in units if n % w == 0 and n >= w]
        if sizes:
            found, _ = plan(prof, workload, slos, sizes, transport, target, exhaustive_up_to)
            results += [FleetResult(r.fleet, r.at_rate, r.capacity_rps, w) for r in found]
    if not results:
        raise ValueError(f"no profile's instance width ({', '.join(str(p.width) for p in profiles)}) fits "
                         f"{', '.join(map(str, units))} units")
    return results, choose(results, workload.rate)


def resolve_slo(spec: str, profile: Profile, workload: Workload) -> dict[str, float]:
    """parse_slo's ttft:MS,tpot:MS, where tpot:xF means F times the unloaded decode step (one
    sequence at the workload's mean context: prompt + half the output) on this profile."""
    items = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition(":")
        if key == "tpot" and value.startswith("x"):
            try:
                factor = float(value[1:])
            except ValueError:
                factor = -1.0
            if factor <= 0:
                raise ValueError(f"bad SLO {item!r}: tpot:xF needs a factor F > 0")
            context = round(workload.mean_isl + workload.mean_osl / 2)
            item = f"tpot:{1000 * factor * profile.step.decode_seconds(1, context)}"
        items.append(item)
    return parse_slo(",".join(items))


def _instances(spec: str) -> list[int]:
    try:
        if "-" in spec:
            lo, hi = (int(x) for x in spec.split("-"))
            out = list(range(lo, hi + 1))
        else:
            out = [int(x) for x in spec.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"bad --instances {spec!r}: use N, N,M or LO-HI (each >= 1)")
    return out


def parse_fleet(spec: str, transport: str = "tcp") -> Fleet:
    """'1P+3D' (disaggregated) or '4C' (colocated)."""
    m = re.fullmatch(r"(\d+)P\+(\d+)D|(\d+)C", spec.strip().upper())
    if m is None:
        raise ValueError(f"bad fleet {spec!r}: use NP+MD (e.g. 1P+3D) or NC (e.g. 4C)")
    if m.group(3) is not None:
        return Fleet(num_colocated=int(m.group(3)))
    return Fleet(num_prefill=int(m.group(1)), num_decode=int(m.group(2)), transport=transport)


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="simulate one fleet on a workload with a profile; print its metrics",
                              description="One fleet, one workload: TTFT/TPOT/ITL percentiles, the longest stall, "
                                          "goodput and attainment at the SLOs.")
    p.add_argument("--profile", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--fleet", required=True, help="NP+MD or NC, e.g. 1P+1D, 2C")
    p.add_argument("--slo", default=None, help="ttft:MS,tpot:MS (tpot:xF: F x the unloaded decode step)")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--json", action="store_true", help="the whole summary as JSON")
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(args) -> int:
    import json

    profile = Profile.load(args.profile)
    wl = workloads.load(args.workload)
    fleet = parse_fleet(args.fleet, args.transport)
    slos = resolve_slo(args.slo, profile, wl) if args.slo else None
    s = summarize(simulate(profile, fleet, list(wl.requests)), slos)
    if args.json:
        print(json.dumps({"fleet": fleet.name, **s}, indent=1))
        return 0
    print(f"{fleet.name} on {wl.description}")
    for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("longest stall per request", "max_stall")):
        print(f"{label + ' p50/p90/p99 ms':<40}" + " / ".join(f"{s[f'p{p}_{key}_ms']:.1f}" for p in (50, 90, 99)))
    print(f"{'longest inter-token gap ms':<40}{s['max_itl_ms']:.1f}")
    if slos:
        print(f"{'goodput req/s (in SLO)':<40}{s['request_goodput']:.3f} ({100 * s['slo_attainment']:.0f}%)")
    return 0


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="simulate P:D splits and colocated fleets on a workload; print the "
                                           "alternatives and the best", description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, action="append",
                   help="a profile file from `pdserve profile`; repeat it for profiles of one model at other "
                        "instance widths (e.g. --num-threads 1 and 2): the first sets tpot:xF's step")
    p.add_argument("--workload", required=True, help="a workload file (JSON; see docs/planning.md)")
    p.add_argument("--slo", required=True, help="ttft:MS,tpot:MS; tpot:xF = F x the unloaded decode step "
                                                "(e.g. tpot:x1.5, a tight SLO)")
    p.add_argument("--instances", default="2", help="fleet sizes to try, in units (GPUs; cores of CPU profiles: a "
                                                    "2-thread instance is 2): N, N,M or LO-HI (default 2)")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="fraction of requests that must meet the SLOs for a rate to count (default 0.9)")
    p.add_argument("--exhaustive-up-to", type=int, default=EXHAUSTIVE_UP_TO,
                   help="simulate every P:D split of fleets up to this size; larger ones: a search for the best "
                        f"split (default {EXHAUSTIVE_UP_TO})")
    p.add_argument("--transport", default=None, help="KV transport of P/D fleets (default: tcp, else the "
                                                     "profile's first)")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args) -> int:
    if not 0 < args.attainment <= 1:
        raise ValueError("--attainment must be in (0, 1]")
    profiles = [Profile.load(p) for p in args.profile]
    profile = profiles[0]
    wl = workloads.load(args.workload)
    slos = resolve_slo(args.slo, profile, wl)
    transport = args.transport or ("tcp" if "tcp" in profile.transfers else next(iter(profile.transfers), "tcp"))
    results, best = plan_widths(profiles, wl, slos, _instances(args.instances), transport, args.attainment,
                                args.exhaustive_up_to)
    print(f"workload: {wl.description} (mean rate {wl.rate:.3g} req/s, ISL {wl.mean_isl:.0f}, OSL {wl.mean_osl:.0f})")
    slo_ms = ",".join(f"{k}:{v * 1000:.4g}" for k, v in slos.items())
    print(f"profile: {profile.source} on {profile.machine.get('device', '?')}; SLOs {slo_ms} (ms); capacity = "
          f"highest rate with >= {100 * args.attainment:.0f}% of requests in SLO")
    print(table(results, wl.rate))
    carries = "carries" if best.capacity_rps >= wl.rate else "does NOT carry (no fleet tried does)"
    print(f"best: {best.name} ({best.capacity_per_unit:.3f} req/s per unit; {carries} "
          f"{wl.rate:.3g} req/s)")
    return 0
