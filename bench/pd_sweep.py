"""bench-pd as a sweep: per ISL:OSL shape and SLO, the planner's choice (1P+1D, 2C or 1Cx2) against the others and vLLM CPU.

Two cores: the fleets are one prefill + one decode (a core each), two colocated instances (a
core each), as bench-pd runs them, or one colocated instance two threads wide on both cores
(1Cx2); vLLM's CPU build gets both cores. Steps:

1. Profiles of this machine (`pdserve profile`, bench-pd's model): one thread on core 0 and two
   threads on both cores, or `--profile FILE` (repeatable: one per width).
2. Per cell (ISL:OSL 1:1, 10:1, 1:10 at 2-core sizes; loose SLO: bench-pd's TTFT 4 s, TPOT 100 ms;
   tight: TPOT 1.5 x the one-thread profile's unloaded decode step): `pdserve plan --instances 2`
   with both profiles on the cell's requests gives each fleet's simulated capacity and the
   choice; the cell's arrival rate is `--load` (0.8) x the highest capacity, unless `--rate` is
   given.
3. Each configuration serves every cell (fresh prompts per cell: no prefix-cache hits between
   runs); per-request SLO attainment, goodput, TTFT p90, ITL p99 and the longest stall. Every
   configuration's stack is up at once; within a cell they take turns (one serves at a time),
   each cell starting with the next configuration, so a slow phase of the machine falls on all
   of them rather than on the one measured last.

Prints per cell whether the plan's choice was the measured winner (or within noise: one request
in SLO over the run, or 10%), and `planned_vs_vllm_goodput_min_ratio` over the cells (vLLM not
runnable here: reported as not run, the ratio nan).

`--capacity` measures what the plan predicts instead: each configuration's capacity, the highest
arrival rate at which `--attainment` (0.9) of a rung's requests meet both SLOs (DistServe's
goodput). Rungs step by `--rung-factor` (1.2) from the configuration's simulated capacity (the
cell's rate for vLLM), up while a rung passes and down while it fails; each rung is
`--rung-seconds` (60) of arrivals at its rate (at least `--rung-prompts`), fresh requests of the
cell's shape drawn from one stream per rung. A rung must last: an overloaded fleet's queue grows
by the excess rate, and a short burst is absorbed by the batch (40 requests of the 1:1 and 1:10
shapes held the loose SLOs at 3-5x the simulated capacity, and at 21 req/s). The simulated
capacities (and the plan) come from `--plan-requests` (300) requests of the shape, as the rungs
serve many draws of it, not the cell's 12. Two capacities within one rung are a tie. Every
configuration's stack is up at once and their searches take turns, a rung each (only one serves
at a time), so a slow phase of the machine falls on all of them rather than on the one it met.
A steady drift still favours the configuration that climbs (its high rungs fall in the late
rounds), so where another configuration measured a higher capacity than the plan's choice, the
two then serve that capacity's rung again back to back, the same requests at the same rate, and
`planned_vs_vllm_capacity_min_ratio_like_rates` counts a cell where the plan's choice held vLLM's
capacity there as level (1.0).

Each configuration also serves one request alone (1,024 prompt tokens, 64 out) before and after
its cells: the report prints it against the profile's prediction (`profile_drift`: the plan is
only as good as the profile is of the machine now; past 20% it says to profile again) and the
move between the two (`machine_drift`), as sim_validate does. With `--capacity` one of them (a
one-thread pdserve stack where there is one) also serves it before each round of rungs: the report
prints the machine's move round by round and `machine_drift_during_search`, and says where a move
past 20% makes failed rungs the machine's rather than the configurations'.

    python -m bench.pd_sweep [--quick] [--profile FILE]... [--configs disaggregated,colocated,colocated-wide,vllm]
    python -m bench.pd_sweep --capacity [--shapes 1:1,1:10] [--slos loose] [--profile FILE]...
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.capacity import Ladder, interleave, rotated, rung_size, search  # noqa: E402
from bench.pd_bench import BUILD, ensure_model, start_pdserve, start_vllm  # noqa: E402
from bench.procs import exit_on_signals  # noqa: E402
from bench.serve import run_benchmark  # noqa: E402
from bench.sim_validate import ARRIVAL_SEED, PROBE, fresh_profile, probe_requests, sim_requests  # noqa: E402
from bench.workloads import synthetic  # noqa: E402
from services.planner.plan import choose, plan_widths, resolve_slo  # noqa: E402
from services.planner.profile_data import Profile  # noqa: E402
from services.planner.sim_metrics import summarize  # noqa: E402
from services.planner.simulator import Fleet, simulate  # noqa: E402
from services.planner.workload import Workload  # noqa: E402

# Prompt and output lengths per shape, sized so that a cell's requests take about a minute here.
SHAPES = {"1:1": ("uniform:192:320", "uniform:192:320"), "10:1": ("uniform:1024:2048", "uniform:100:200"),
          "1:10": ("uniform:24:40", "uniform:240:400")}
QUICK_SHAPE = ("uniform:48:80", "uniform:16:24")  # --quick's one cell: short prompts, short outputs
SLOS = {"loose": "ttft:4000,tpot:100", "tight": "ttft:4000,tpot:x1.5"}
FLEET_OF = {"1P+1D": "disaggregated", "2C": "colocated", "1Cx2": "colocated-wide"}
PDSERVE = ("disaggregated", "colocated", "colocated-wide")
NOISE_REL = 0.1  # goodput within 10% (or one request in SLO over the run) is a tie
QUICK_PROBE = ("fixed:64", "fixed:8")
PROBED = ("p50_ttft_ms", "p50_tpot_ms")
# A lone request this much slower or faster than its profile predicts: the plan was made for a
# machine of another speed (this VM's moved 30-50% within hours; sim_validate's machine_drift).
STALE = 0.2
GAUGE_SEED = 200_000  # the gauge's prompts: clear of the probes' (99-101) and the rungs' (~100_000 + 500)


@dataclass
class Cell:
    shape: str
    slo: str
    requests: list
    slos: dict  # seconds
    rate: float
    planned: str  # "disaggregated" | "colocated" | "colocated-wide"
    predicted: dict  # config -> simulated capacity (req/s)
    lengths: tuple[str, str] = ("", "")  # the shape's input and output length distributions
    seed: int = 0  # of the cell's requests; capacity rungs draw theirs from it


def move(now: dict, base: dict) -> float:
    """The larger relative move of `now` from `base`, TTFT or TPOT, with its sign (0: nothing to compare)."""
    return max((now[k] / base[k] - 1 for k in PROBED if base[k] > 0), key=abs, default=0.0)


@dataclass
class Probe:
    """One request alone on a configuration before and after its cells, and what the profile of its
    width predicts for it: how far the machine is from the profile the plan used, and how far it
    moved while the configuration was measured."""
    before: dict
    after: dict | None = None
    predicted: dict | None = None  # vLLM, or no profile of the configuration's width: none

    def profile_error(self) -> float:
        """The first probe's larger relative move from the prediction, TTFT or TPOT (0 unpredicted)."""
        return move(self.before, self.predicted) if self.predicted else 0.0

    def moved(self) -> float:
        """The larger relative move between the two probes, TTFT or TPOT (0 without the second)."""
        return move(self.after, self.before) if self.after else 0.0


@dataclass
class Gauge:
    """The machine's speed while interleaved searches run: one request alone on one stack before
    each round of rungs. The rungs of a round alternate between configurations, so a move of the
    machine falls on all of them alike, but the tight SLO is fixed from the profile: a machine
    slower by more than STALE fails rungs its configurations would hold, and only the ratios
    between them still say something."""
    name: str
    url: str
    lengths: tuple[str, str]  # the probe's
    seed: int  # round r's prompt: seed + r (a repeat would hit the prefix cache)
    readings: list = field(default_factory=list)
    on_reading: Callable[[], None] | None = None  # after each reading (the sweep saves gauge.json: a stopped run keeps it)

    def __call__(self, round_: int) -> None:
        probe = synthetic(1, *self.lengths, vocab_size=4000, seed=self.seed + round_)
        s = asyncio.run(run_benchmark(self.url, None, probe, progress=False))
        self.readings.append({k: s[k] for k in PROBED})
        print(f"  round {round_}: one request alone on {self.name}: TTFT {s['p50_ttft_ms']:.0f} ms, TPOT "
              f"{s['p50_tpot_ms']:.1f} ms ({100 * self.moves()[-1]:+.0f}% from round 0)", flush=True)
        if self.on_reading is not None:
            self.on_reading()

    def moves(self) -> list[float]:
        return [move(r, self.readings[0]) for r in self.readings]

    def drift(self) -> float:
        """The largest move from round 0, with its sign."""
        return max(self.moves(), key=abs, default=0.0)


def transport_of(profile: Profile) -> str:
    return "tcp" if "tcp" in profile.transfers else next(iter(profile.transfers))


def predict_probe(profiles: list[Profile], name: str, probe: list) -> dict | None:
    """The lone request as the simulator predicts it on that configuration's profile (None for vLLM
    or where no profile has the configuration's width)."""
    width = 2 if name == "colocated-wide" else 1
    prof = next((p for p in profiles if p.width == width), None)
    if prof is None or name not in PDSERVE:
        return None
    fleet = (Fleet(num_prefill=1, num_decode=1, transport=transport_of(prof)) if name == "disaggregated"
             else Fleet(num_colocated=1))
    return summarize(simulate(prof, fleet, sim_requests(probe, 1.0)))


def probe_report(probes: dict[str, Probe], lengths: tuple[str, str]) -> None:
    print(f"\nprofile check: one request alone ({lengths[0]} prompt, {lengths[1]} output tokens) on each "
          "configuration before and after its cells, against its profile's prediction")

    def times(s: dict) -> str:
        return f"TTFT {s['p50_ttft_ms']:.0f} ms, TPOT {s['p50_tpot_ms']:.1f} ms"

    for name, p in probes.items():
        pred = "" if p.predicted is None else (f"predicted {times(p.predicted)}; measured "
                                               f"{100 * p.profile_error():+.0f}%: ")
        after = "" if p.after is None else f"; after its cells {times(p.after)} ({100 * p.moved():+.0f}%)"
        print(f"  {name:<16}{pred}before its cells {times(p.before)}{after}")
    worst = max(probes, key=lambda n: abs(probes[n].profile_error()), default=None)
    profile_drift = abs(probes[worst].profile_error()) if worst else 0.0
    print(f"profile_drift={profile_drift:.3f}  (the lone request's largest move from its profile's prediction)")
    print(f"machine_drift={max((abs(p.moved()) for p in probes.values()), default=0.0):.3f}  (its largest "
          "move between a configuration's first and last probe)")
    if profile_drift > STALE:
        print(f"the profiles do not describe this machine now ({worst}'s lone request "
              f"{100 * probes[worst].profile_error():+.0f}% from the prediction): the simulated capacities "
              "and the plan's choice are for another speed; profile again (omit --profile)")


def plan_cell(profiles: list[Profile], shape: str, lengths: tuple[str, str], slo: str, num: int, seed: int,
              rate: float | None, load: float, plan_requests: int = 0) -> Cell:
    """plan_requests: plan on that many requests of the shape (a capacity ladder serves fresh
    draws of it) instead of the cell's own `num`."""
    reqs = synthetic(num, *lengths, vocab_size=4000, seed=seed)
    # The cell's own requests (or the shape's sample) at 1 req/s; plan() scales their arrivals to
    # find each fleet's capacity.
    planned_on = synthetic(plan_requests, *lengths, vocab_size=4000, seed=seed * 1000 + 499) if plan_requests else reqs
    wl = Workload(tuple(sim_requests(planned_on, 1.0)), f"{shape} ({len(planned_on)} requests)")
    slos = resolve_slo(SLOS[slo], profiles[0], wl)
    transport = transport_of(profiles[0])
    # Capacities do not depend on wl's own rate.
    results, _ = plan_widths(profiles, wl, slos, [2], transport)
    capacity = {FLEET_OF[r.name]: r.capacity_rps for r in results if r.name in FLEET_OF}
    cell_rate = rate or load * max(capacity.values())
    if cell_rate <= 0:
        raise ValueError(f"cell {shape} {slo}: no fleet meets the SLOs at any rate in the simulation; "
                         "give --rate")
    best = choose(results, cell_rate)  # what `pdserve plan` picks at the cell's rate
    return Cell(shape, slo, reqs, slos, cell_rate, FLEET_OF[best.name], capacity, lengths, seed)


def measure(url: str, cell: Cell) -> dict:
    s = asyncio.run(run_benchmark(url, None, cell.requests, rate=cell.rate, slos=cell.slos, seed=ARRIVAL_SEED,
                                  progress=False))
    stalls = [max(itl, default=0.0) for itl in s["itls"]]
    s["max_stall_ms"] = 1000 * max(stalls, default=0.0)
    s["good"] = round(s["slo_attainment"] * s["num_prompts"])
    for k in ("input_lens", "output_lens", "ttfts", "itls"):
        s.pop(k)
    return s


def rung_seed(cell: Cell, k: float) -> int:
    """The seed of rung k's requests: cell.seed * 1000 + 500 + k on the ladder's integer rungs; a
    refining rung between two (k + 1/2, ...) draws from a stream of its own."""
    if k == int(k):
        return cell.seed * 1000 + 500 + int(k)
    return 10_000_000 + cell.seed * 10_000 + 5_000 + round(k * 64)


def rung_requests(cell: Cell, k: float, num: int) -> list:
    """Rung k's requests: fresh prompts (no prefix-cache hits from other rungs); every configuration's
    rung k draws from the same stream."""
    return synthetic(num, *cell.lengths, vocab_size=4000, seed=rung_seed(cell, k))


def rung_runner(url: str, cell: Cell, base: float, factor: float, seconds: float, min_prompts: int, log=print):
    """run_rung(k) for one configuration's capacity search on one cell: serves rung k, returns its summary."""
    def run_rung(k: float) -> dict:
        rate = base * factor ** k
        num = rung_size(rate, seconds, min_prompts)
        # Arrivals: ARRIVAL_SEED + k on the integer rungs, as before --refine; a stream of their own between.
        arrivals = ARRIVAL_SEED + rung_seed(cell, k) - rung_seed(cell, 0)
        s = asyncio.run(run_benchmark(url, None, rung_requests(cell, k, num), rate=rate, slos=cell.slos,
                                      seed=arrivals, progress=False))
        out = {"rate": rate, "num_prompts": num, "slo_attainment": s["slo_attainment"],
               "request_goodput": s["request_goodput"], "p90_ttft_ms": s["p90_ttft_ms"],
               "median_tpot_ms": s["median_tpot_ms"], "failed": s["failed"]}
        log(f"rung {k:+g} {rate:.3f} req/s x {num}: {100 * s['slo_attainment']:.0f}% in SLO, TTFT p90 "
            f"{s['p90_ttft_ms']:.0f} ms, TPOT p50 {s['median_tpot_ms']:.1f} ms"
            + (f", {s['failed']} failed" if s["failed"] else ""))
        return out

    return run_rung


def interleaved_capacities(stacks: dict[str, str], cell: Cell, base: dict[str, float], args,
                           gauge: Gauge | None = None) -> dict[str, Ladder]:
    """Every configuration's capacity search on one cell, a rung of each in turn (capacity.interleave:
    each round starts one configuration later), every stack up at once and only one serving: a slow
    phase of the machine falls on all of them, not on the one measured in it. Run one after another,
    the 1:10 tight cell measured pdserve's best fleet at 0.60x vLLM; interleaved the same hour, both
    held every rate up to vLLM's capacity there, pdserve's TPOT ~10% above vLLM's. gauge, if
    given, reads the machine's speed before each round."""
    runners = {name: rung_runner(url, cell, base[name], args.rung_factor, args.rung_seconds, args.rung_prompts,
                                 log=lambda line, name=name: print(f"  {name:<15}{line}", flush=True))
               for name, url in stacks.items()}
    searches = {name: search(args.attainment, args.max_rungs_up, args.max_rungs_down, args.refine) for name in stacks}
    return interleave(searches, lambda name, k: runners[name](k), before_round=gauge)


def like_rate_check(stacks: dict[str, str], cell: Cell, base: dict[str, float], found: dict[str, Ladder],
                    args) -> dict | None:
    """The plan's choice and the configuration that measured the highest capacity serve that
    capacity's rung again, back to back, the same requests at the same arrivals: a ladder run under
    a steady drift favours the configuration that climbs (its high rungs fall in the late rounds),
    and this reads the two at like rates and the same minutes. None where the plan's choice
    measured the highest capacity itself (or either was not run)."""
    planned = cell.planned
    if planned not in found or not found[planned].rungs:
        return None
    top = max(found, key=lambda n: found[n].capacity)
    if top == planned or found[top].capacity <= found[planned].capacity:
        return None
    rate = found[top].capacity
    k = round(math.log(rate / base[top], args.rung_factor) * 64) / 64  # the top's own rung (refined ones too)
    held = {}
    for name in (planned, top):
        run = rung_runner(stacks[name], cell, base[top], args.rung_factor, args.rung_seconds, args.rung_prompts,
                          log=lambda line, name=name: print(f"  {name:<15}like rates, {line}", flush=True))
        held[name] = run(k)["slo_attainment"]
    return {"top": top, "rate": rate, "attainment": held}


def capacity_report(cells: list[Cell], ladders: dict[str, dict[int, Ladder]], not_run: dict[str, str],
                    factor: float, target: float, gauges: dict[int, Gauge] | None = None,
                    checks: dict[int, dict] | None = None) -> int:
    print(f"\ncapacity: the highest rate with >= {100 * target:.0f}% of a rung's requests in SLO (rungs x{factor:g} "
          "from the simulated capacity; '>=' where no rung above failed)")
    print(f"{'cell':<16}{'config':<16}{'measured':>10}{'predicted':>11}{'pred/meas':>11}  rungs (req/s: % in SLO)")
    wins, worst, worst_like, below = [], math.inf, math.inf, []
    for i, c in enumerate(cells):
        print(f"-- {c.shape} {c.slo} (TTFT {1000 * c.slos['ttft']:.0f} ms, TPOT {1000 * c.slos['tpot']:.1f} ms); "
              f"plan: {c.planned}")
        for name in (*PDSERVE, "vllm"):
            lad = ladders.get(name, {}).get(i)
            if lad is None:
                continue
            mark = "*" if name == c.planned else " "
            pred = c.predicted.get(name)
            cap = f"{'' if lad.bounded else '>='}{lad.capacity:.3f}"
            rel = f"{pred / lad.capacity:.2f}" if pred is not None and lad.capacity > 0 else ""
            steps = ", ".join(f"{r['rate']:.2f}: {100 * r['slo_attainment']:.0f}%"
                              for r in sorted(lad.rungs, key=lambda r: r["rate"]))
            print(f"{'':<15}{mark}{name:<16}{cap:>9}{'' if pred is None else format(pred, '.3f'):>11}{rel:>11}  {steps}")
        mine = {n: ladders[n][i] for n in PDSERVE if i in ladders.get(n, {})}
        if len(mine) > 1 and c.planned in mine:
            best = max(mine.values(), key=lambda lad: lad.capacity)
            # Within one rung: the ladder cannot order two capacities closer than its step.
            won = mine[c.planned].capacity * factor >= best.capacity * (1 - 1e-9)
            wins.append(won)
            print(f"{'':<16}plan's choice {c.planned}: "
                  f"{'measured winner or within one rung' if won else 'LOST'} ({mine[c.planned].capacity:.3f} vs "
                  f"best {best.capacity:.3f} req/s)")
        check = (checks or {}).get(i)
        if check is not None:
            got = check["attainment"]
            print(f"{'':<16}at like rates ({check['top']}'s capacity, {check['rate']:.3f} req/s, the same requests back "
                  f"to back): {c.planned} {100 * got[c.planned]:.0f}% in SLO, {check['top']} "
                  f"{100 * got[check['top']]:.0f}%")
        if c.planned in mine and i in ladders.get("vllm", {}):
            theirs = ladders["vllm"][i]
            if theirs.capacity <= 0 and theirs.rungs:  # vLLM held no rung: its capacity is under its lowest
                below.append(min(rung["rate"] for rung in theirs.rungs))
                r = ratio(mine[c.planned].capacity, below[-1])
                print(f"{'':<16}vLLM held no rung down to {below[-1]:.3f} req/s: planned/vLLM is above {r:.3f}")
            else:
                r = ratio(mine[c.planned].capacity, theirs.capacity)
            worst = min(worst, r)
            # Where the plan's choice held vLLM's capacity at like rates, it is level with vLLM there.
            level = (check is not None and check["top"] == "vllm"
                     and check["attainment"][c.planned] >= target - 1e-9)
            worst_like = min(worst_like, max(r, 1.0) if level else r)
        gauge = (gauges or {}).get(i)
        if gauge is not None and gauge.readings:
            print(f"{'':<16}the machine, round by round (one request alone on {gauge.name}): "
                  + ", ".join(f"{100 * m:+.0f}%" for m in gauge.moves()))
            if abs(gauge.drift()) > STALE:
                print(f"{'':<16}the machine moved {100 * gauge.drift():+.0f}% during the search: rungs failed "
                      "after the move may be the machine's; the configurations' rungs alternated, so their "
                      "ratios hold better than the capacities against the profile's SLO")
    for name, why in not_run.items():
        print(f"{name}: not run ({why})")
    vllm_note = "" if "vllm" in ladders else "  (vLLM not run)"
    if below:
        vllm_note = (f"  (a lower bound: vLLM held no rung in {len(below)} cell(s), its capacity there under "
                     f"its lowest rung, {min(below):.3f} req/s)")
    print(f"\nplan_choice_won_capacity_cells={sum(wins)}/{len(wins)}")
    print(f"planned_vs_vllm_capacity_min_ratio={worst if worst != math.inf else math.nan:.3f}{vllm_note}")
    if checks:
        print(f"planned_vs_vllm_capacity_min_ratio_like_rates={worst_like if worst_like != math.inf else math.nan:.3f}"
              "  (1.0 in a cell where the plan's choice held vLLM's capacity at like rates)")
    drifts = [abs(g.drift()) for g in (gauges or {}).values() if g.readings]
    if drifts:
        print(f"machine_drift_during_search={max(drifts):.3f}  (the lone request's largest move from a search's "
              "first round)")
    return 0


def within_noise(planned: dict, best: dict) -> bool:
    one_request = 1.0 / max(best["duration"], 1e-9)
    gap = best["request_goodput"] - planned["request_goodput"]
    return gap <= max(one_request, NOISE_REL * best["request_goodput"]) + 1e-12


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else math.nan)


def report(cells: list[Cell], results: dict[str, dict], not_run: dict[str, str]) -> int:
    print(f"\n{'cell':<13}{'rate':>6} {'config':<14}{'in SLO':>7}{'goodput':>9}{'TTFT p90':>10}{'TPOT p50':>10}"
          f"{'ITL p99':>9}{'max stall':>10}  predicted cap.")
    worst, wins = math.inf, []
    for i, c in enumerate(cells):
        tpot = 1000 * c.slos["tpot"]
        print(f"-- {c.shape} {c.slo} (TTFT {1000 * c.slos['ttft']:.0f} ms, TPOT {tpot:.1f} ms); plan: {c.planned}")
        for name in (*PDSERVE, "vllm"):
            s = results.get(name, {}).get(i)
            if s is None:
                continue
            mark = "*" if name == c.planned else " "
            pred = f"{c.predicted[name]:.3f}" if name in c.predicted else ""
            print(f"{'':<13}{c.rate:>6.3f} {mark}{name:<13}{100 * s['slo_attainment']:>6.0f}%{s['request_goodput']:>9.3f}"
                  f"{s['p90_ttft_ms']:>10.0f}{s['median_tpot_ms']:>10.1f}{s['p99_itl_ms']:>9.1f}"
                  f"{s['max_stall_ms']:>10.0f}  {pred}")
        mine = {n: results[n][i] for n in PDSERVE if i in results.get(n, {})}
        if len(mine) > 1 and c.planned in mine:
            best = max(mine.values(), key=lambda s: s["request_goodput"])
            won = mine[c.planned] is best or within_noise(mine[c.planned], best)
            wins.append(won)
            print(f"{'':<13}plan's choice {c.planned}: {'measured winner or within noise' if won else 'LOST'} "
                  f"({mine[c.planned]['request_goodput']:.3f} vs best {best['request_goodput']:.3f} req/s)")
        if c.planned in mine and i in results.get("vllm", {}):
            worst = min(worst, ratio(mine[c.planned]["request_goodput"], results["vllm"][i]["request_goodput"]))
    for name, why in not_run.items():
        print(f"{name}: not run ({why})")
    vllm_note = "" if "vllm" in results else "  (vLLM not run)"
    print(f"\nplan_choice_won_cells={sum(wins)}/{len(wins)}")
    print(f"planned_vs_vllm_goodput_min_ratio={worst if worst != math.inf else math.nan:.3f}{vllm_note}  "
          "(target >= 1.0)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke test: a quick profile, one small cell (1:1 "
                                                         "loose, 4 short requests), pdserve only")
    ap.add_argument("--profile", default=None, action="append",
                    help="plan from this profile instead of measuring them first (repeat for the one- and "
                         "two-thread profiles; the first sets the tight TPOT)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--slos", default=",".join(SLOS))
    ap.add_argument("--num-prompts", type=int, default=12, help="requests per cell")
    ap.add_argument("--rate", type=float, default=None, help="arrival rate of every cell (default: --load x "
                                                              "the higher simulated capacity)")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--configs", default="disaggregated,colocated,colocated-wide,vllm")
    ap.add_argument("--capacity", action="store_true",
                    help="measure each configuration's capacity per cell (rungs of rates) instead of one run "
                         "at the cell's rate")
    ap.add_argument("--rung-seconds", type=float, default=60.0,
                    help="--capacity: seconds of arrivals per rung (rate x seconds requests)")
    ap.add_argument("--rung-prompts", type=int, default=20, help="--capacity: fewest requests per rung")
    ap.add_argument("--rung-factor", type=float, default=1.2, help="--capacity: rate ratio of adjacent rungs")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="--capacity: share of a rung's requests in SLO for the rung to pass (as `pdserve plan`)")
    ap.add_argument("--plan-requests", type=int, default=300,
                    help="--capacity: the simulated capacities (and the plan) from this many requests of the "
                         "shape, as the rungs draw theirs (a cell's 12 requests are too few: the 10:1 shape's "
                         "1-2k-token prompts put 1P+1D's at 1.44x what 300 give)")
    ap.add_argument("--refine", type=int, default=0,
                    help="--capacity: bisections (in the exponent) between the highest passing rung and the "
                         "lowest failing one, each a rung of its own (two: a quarter of --rung-factor's step)")
    ap.add_argument("--max-rungs-up", type=int, default=6)
    ap.add_argument("--max-rungs-down", type=int, default=6)
    ap.add_argument("--out", default=os.path.join(BUILD, "sweep"))
    args = ap.parse_args(argv)
    shapes, slos = args.shapes.split(","), args.slos.split(",")
    if not set(shapes) <= set(SHAPES) or not set(slos) <= set(SLOS):
        ap.error(f"--shapes from {', '.join(SHAPES)}; --slos from {', '.join(SLOS)}")
    configs = args.configs.split(",")
    not_run = {}
    if (args.rung_factor <= 1 or args.rung_prompts < 1 or args.rung_seconds < 0 or not 0 < args.attainment <= 1
            or args.plan_requests < 1 or args.refine < 0):
        ap.error("--rung-factor > 1, --rung-prompts >= 1, --rung-seconds >= 0, 0 < --attainment <= 1, "
                 "--plan-requests >= 1 and --refine >= 0")
    if args.quick:
        shapes, slos, args.num_prompts, args.plan_requests = ["1:1"], ["loose"], 4, 4
        args.rung_prompts, args.rung_seconds, args.max_rungs_up, args.max_rungs_down = 4, 0.0, 1, 1
        for name in ("vllm", "colocated-wide"):
            if name in configs:
                configs.remove(name)
                not_run[name] = "--quick"
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    model = ensure_model()
    if args.profile:
        profiles = [Profile.load(p) for p in args.profile]
    else:
        widths = [1] if args.quick or "colocated-wide" not in configs else [1, 2]
        profiles = [fresh_profile(model, args.quick, os.path.join(args.out, f"profile-{w}thread.json"), w)
                    for w in widths]
    for prof in profiles:
        print(f"profile: {prof.width} thread(s), {prof.source}; unloaded decode step "
              f"{1000 * prof.step.decode_seconds(1, 512):.1f} ms at 512 tokens", flush=True)
    lengths = {sh: QUICK_SHAPE if args.quick else SHAPES[sh] for sh in shapes}
    # Seeds by the cell's place in the full sweep: a subset (--shapes, --slos) draws the same requests.
    cells = [plan_cell(profiles, shape, lengths[shape], slo, args.num_prompts,
                       100 + list(SHAPES).index(shape) * len(SLOS) + list(SLOS).index(slo), args.rate, args.load,
                       args.plan_requests if args.capacity else 0)
             for shape, slo in ((sh, sl) for sh in shapes for sl in slos)]
    for c in cells:
        print(f"cell {c.shape} {c.slo}: rate {c.rate:.3f} req/s; simulated capacity "
              + ", ".join(f"{k} {v:.3f}" for k, v in c.predicted.items()) + f"; plan: {c.planned}", flush=True)
    results: dict[str, dict[int, dict]] = {}
    ladders: dict[str, dict[int, Ladder]] = {}
    warmup = synthetic(2, "fixed:64", "fixed:8", vocab_size=4000, seed=0)
    probe_lengths = QUICK_PROBE if args.quick else PROBE
    warm_probe, first_probe, last_probe = probe_requests(probe_lengths)
    probes: dict[str, Probe] = {}
    logs = os.path.join(args.out, "logs")

    def start(name: str):
        """The configuration's stack, warmed up and probed; None (and why, in not_run) where it cannot run."""
        try:
            cfg, url = (start_vllm(model, logs) if name == "vllm"
                        else start_pdserve(name, model, logs, name == "disaggregated", [],
                                           wide=name == "colocated-wide"))
        except Exception as e:  # vLLM not installable or not runnable here: the rest still counts
            not_run[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: not run ({not_run[name]})", flush=True)
            return None
        try:
            asyncio.run(run_benchmark(url, None, warmup, progress=False))
            asyncio.run(run_benchmark(url, None, warm_probe, progress=False))  # the probe's shapes warmed up
            probes[name] = Probe(asyncio.run(run_benchmark(url, None, first_probe, progress=False)),
                                 predicted=predict_probe(profiles, name, first_probe))
        except BaseException:
            cfg.stop()
            raise
        return cfg, url

    # Every stack up at once (one serves at a time), the configurations taking turns within each
    # cell, each cell starting one configuration later: a slow phase of the machine falls on all
    # of them alike rather than on the one measured last.
    stacks, gauges, checks = {}, {}, {}

    def save_gauges():
        with open(os.path.join(args.out, "gauge.json"), "w") as f:
            json.dump({k: {"config": g.name, "readings": g.readings} for k, g in gauges.items()}, f)

    try:
        for name in configs:
            started = start(name)
            if started is not None:
                stacks[name] = started
        for i, c in enumerate(cells):
            if args.capacity:
                print(f"  {c.shape} {c.slo}: capacity, {', '.join(stacks)} in turn", flush=True)
                if stacks:  # the gauge on a one-thread pdserve stack where there is one
                    ref = next((n for n in ("colocated", "disaggregated") if n in stacks), next(iter(stacks)))
                    gauges[i] = Gauge(ref, stacks[ref][1], probe_lengths, GAUGE_SEED + 1000 * i, on_reading=save_gauges)
                urls = {n: url for n, (_, url) in stacks.items()}
                base = {n: c.predicted.get(n) or c.rate for n in stacks}
                found = interleaved_capacities(urls, c, base, args, gauges.get(i))
                check = like_rate_check(urls, c, base, found, args)
                if check is not None:
                    checks[i] = check
                for name, lad in found.items():
                    ladders.setdefault(name, {})[i] = lad
                    with open(os.path.join(args.out, f"{name}-capacity.json"), "w") as f:
                        json.dump({k: vars(v) for k, v in ladders[name].items()}, f)
                continue
            for name in rotated(list(stacks), i):
                s = measure(stacks[name][1], c)
                if s["failed"]:
                    print(f"  {name} {c.shape} {c.slo}: {s['failed']} requests failed: "
                          f"{[e for e in s['errors'] if e][:2]}", flush=True)
                results.setdefault(name, {})[i] = s
                print(f"  {name} {c.shape} {c.slo}: {100 * s['slo_attainment']:.0f}% in SLO, goodput "
                      f"{s['request_goodput']:.3f} req/s, max stall {s['max_stall_ms']:.0f} ms", flush=True)
                with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                    json.dump(results[name], f)
        for name, (_, url) in stacks.items():
            probes[name].after = asyncio.run(run_benchmark(url, None, last_probe, progress=False))
    finally:
        for cfg, _ in stacks.values():
            cfg.stop()
    with open(os.path.join(args.out, "probes.json"), "w") as f:
        json.dump({n: {"predicted": p.predicted and {k: p.predicted[k] for k in PROBED},
                       **{w: s and {k: s[k] for k in PROBED} for w, s in (("before", p.before), ("after", p.after))}}
                   for n, p in probes.items()}, f)
    probe_report(probes, probe_lengths)
    if args.capacity:
        return capacity_report(cells, ladders, not_run, args.rung_factor, args.attainment, gauges, checks)
    return report(cells, results, not_run)


if __name__ == "__main__":
    exit_on_signals()  # SIGTERM stops the stack this started, too
    sys.exit(main())
