"""Cluster scale by simulation: the best P/D split against colocated, 8 to 64 GPUs, three ISL:OSL shapes, two SLOs.

Profiles are the datasheet rooflines of `pdserve profile --roofline h100|h200` (Llama-3-8B, BF16;
sources and assumed efficiencies in docs/planning.md), not measurements. For each GPU, shape
(ISL:OSL 1:1, 10:1, 1:10), SLO (loose, tight) and fleet size N, `pdserve plan`'s search gives
each fleet's capacity: the highest Poisson arrival rate at which 90% of the requests meet both
SLOs (DistServe's goodput). Goodput per GPU is that capacity / N; P/D is its best P:D split.

    python -m bench.sim_cluster [--gpus h100,h200] [--instances 8,16,32,64] [--jobs 2] [--quick]

Cost: simulating grows with requests x output tokens and each cell needs requests in proportion
to N; on this 2-core box a 64-GPU 10:1 cell takes ~6 min, an 8-GPU one ~16 s, and the whole
default grid a few hours, the 1:10 cells most (`--shapes 10:1 --slos tight` is the headline
alone; `--quick` runs in well under a minute).
Prints the table and `sim_pd_vs_colocated_goodput_per_gpu` for the 10:1 shape at the tight SLO
(the worst ratio over the fleet sizes); `--out` keeps every cell as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from services.planner import workload as workloads  # noqa: E402
from services.planner.plan import FACTOR_LIMIT, plan, resolve_slo  # noqa: E402
from services.planner.profile_data import GPUS, LLAMA3_8B, roofline_profile  # noqa: E402

# (ISL, OSL) per shape; simulating 1:10 costs ~OSL events per request, which bounds its length.
SHAPES = {"1:1": (512, 512), "10:1": (2048, 205), "1:10": (128, 1280)}
# tpot:xF = F x the unloaded decode step (one sequence at the mean context) on the profile.
SLOS = {"loose": "ttft:2000,tpot:x5", "tight": "ttft:500,tpot:x1.5"}
HEADLINE = ("10:1", "tight")
SEED = 1


@dataclass(frozen=True)
class Cell:
    gpu: str
    shape: str
    slo: str
    instances: int
    isl: int
    osl: int
    num_requests: int
    transport: str
    attainment: float
    exhaustive_up_to: int


def rate_guess(profile, isl: int, osl: int, n: int) -> float:
    """Where to start the capacity search: an instance prefilling alone and decoding 16 at a time.
    Only the number of doublings depends on it, not the capacity found."""
    decode = profile.step.decode_seconds(16, isl + osl // 2) / 16
    return n / (profile.step.prefill_seconds(isl, profile.max_num_batched_tokens) + osl * decode)


def run_cell(cell: Cell) -> dict:
    t0 = time.perf_counter()
    profile = roofline_profile(cell.gpu, LLAMA3_8B)
    wl = workloads.poisson(rate_guess(profile, cell.isl, cell.osl, cell.instances), cell.num_requests,
                           f"fixed:{cell.isl}", f"fixed:{cell.osl}", seed=SEED)
    slos = resolve_slo(SLOS[cell.slo], profile, wl)
    results, _ = plan(profile, wl, slos, [cell.instances], cell.transport, cell.attainment, cell.exhaustive_up_to)
    splits = [r for r in results if r.fleet.disaggregated]
    pd = max(splits, key=lambda r: (r.capacity_per_unit, -r.fleet.num_prefill))
    colo = next(r for r in results if not r.fleet.disaggregated)
    ratio = pd.capacity_per_unit / colo.capacity_per_unit if colo.capacity_rps > 0 else float("inf")
    # A capacity at the search's limit is a burst the fleet absorbed, not a steady state: too few
    # requests for its seats (simulate more per GPU); the table marks it.
    at_limit = [r.fleet.name for r in (pd, colo) if r.capacity_rps >= wl.rate * FACTOR_LIMIT]
    return {**asdict(cell), "slos_ms": {k: v * 1000 for k, v in slos.items()}, "at_search_limit": at_limit,
            "pd_fleet": pd.fleet.name, "pd_per_gpu": pd.capacity_per_unit,
            "colocated_per_gpu": colo.capacity_per_unit, "ratio": ratio,
            "splits": {r.fleet.name: r.capacity_per_unit for r in splits},
            "seconds": time.perf_counter() - t0}


def cells_of(args) -> list[Cell]:
    scale = args.scale
    cells = []
    for gpu in args.gpus:
        for shape in args.shapes:
            isl, osl = (max(1, round(x * scale)) for x in SHAPES[shape])
            for slo in args.slos:
                for n in args.instances:
                    cells.append(Cell(gpu, shape, slo, n, isl, osl, max(args.min_requests, args.requests_per_gpu * n),
                                      args.transport, args.attainment, args.exhaustive_up_to))
    # The headline's cells first, then the cheapest (fewest requests x tokens to generate): a run
    # stopped early has the most rows.
    return sorted(cells, key=lambda c: ((c.shape, c.slo) != HEADLINE, c.num_requests * c.osl))


def table(rows: list[dict]) -> str:
    lines = [f"{'gpu':<6}{'ISL:OSL':<15}{'SLO':<7}{'TTFT/TPOT ms':>14}{'GPUs':>6}{'best P/D':>10}"
             f"{'P/D':>9}{'coloc':>9}{'P/D/coloc':>11}",
             f"{'':<6}{'':<15}{'':<7}{'':>14}{'':>6}{'':>10}{'req/s/GPU':>18}{'':>11}"]
    order = {s: i for i, s in enumerate(SHAPES)}
    for r in sorted(rows, key=lambda r: (r["gpu"], order[r["shape"]], r["slo"] != "loose", r["instances"])):
        slo = f"{r['slos_ms']['ttft']:.0f}/{r['slos_ms']['tpot']:.1f}"
        ratio = "n/d" if r["at_search_limit"] else f"{r['ratio']:.2f}"
        lines.append(f"{r['gpu']:<6}{r['shape'] + ' ' + str(r['isl']) + ':' + str(r['osl']):<15}{r['slo']:<7}"
                     f"{slo:>14}{r['instances']:>6}{r['pd_fleet']:>10}{r['pd_per_gpu']:>9.2f}"
                     f"{r['colocated_per_gpu']:>9.2f}{ratio:>11}"
                     + ("  (search limit: " + ", ".join(r["at_search_limit"]) + ")" if r["at_search_limit"] else ""))
    return "\n".join(lines)


def headline(rows: list[dict]) -> float:
    """The worst P/D-over-colocated ratio of goodput per GPU on the 10:1 shape at the tight SLO
    (cells whose capacity is at the search limit have no ratio)."""
    cells = [r for r in rows if (r["shape"], r["slo"]) == HEADLINE and not r["at_search_limit"]]
    return min(r["ratio"] for r in cells) if cells else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="h100,h200", type=lambda s: s.split(","))
    ap.add_argument("--instances", default="8,16,32,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--shapes", default=",".join(SHAPES), type=lambda s: s.split(","))
    ap.add_argument("--slos", default=",".join(SLOS), type=lambda s: s.split(","))
    ap.add_argument("--requests-per-gpu", type=int, default=64,
                    help="Poisson requests simulated per GPU at each rate (at least --min-requests)")
    ap.add_argument("--min-requests", type=int, default=300)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every shape's ISL and OSL")
    ap.add_argument("--transport", default="nccl", help="the P->D KV link (the roofline's: NVLink)")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--exhaustive-up-to", type=int, default=4,
                    help="fleets up to this size simulate every P:D split; larger ones search for the best")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="cells simulated in parallel")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: one GPU, 4 instances, shapes at 1/16 size, 60 requests")
    ap.add_argument("--out", default=None, help="write every cell as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.gpus, args.instances, args.scale, args.min_requests = args.gpus[:1], [4], 1 / 16, 60
    unknown = [g for g in args.gpus if g not in GPUS]
    if (unknown or min(args.instances) < 2 or not set(args.shapes) <= set(SHAPES)
            or not set(args.slos) <= set(SLOS)):
        ap.error(f"--gpus from {', '.join(GPUS)}; --shapes from {', '.join(SHAPES)}; --slos from "
                 f"{', '.join(SLOS)}; --instances >= 2 (P/D needs two)")
    cells = cells_of(args)
    print(f"{len(cells)} cells: Llama-3-8B BF16 on {', '.join(args.gpus)} rooflines (datasheet, not measured); "
          f"SLOs {SLOS}; goodput = highest rate with >= {100 * args.attainment:.0f}% of requests in SLO", flush=True)
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_cell, c) for c in cells]
        for done, fut in enumerate(as_completed(futures), 1):
            r = fut.result()
            rows.append(r)
            print(f"  [{done}/{len(cells)}] {r['gpu']} {r['shape']} {r['slo']} N={r['instances']}: "
                  f"{r['pd_fleet']} {r['pd_per_gpu']:.2f} vs {r['colocated_per_gpu']:.2f} req/s/GPU "
                  f"({r['seconds']:.0f} s)", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    print()
    print(table(rows))
    print(f"sim_pd_vs_colocated_goodput_per_gpu={headline(rows):.3f}  "
          f"(ISL:OSL {HEADLINE[0]}, {HEADLINE[1]} SLO, worst over {len(args.gpus)} GPU(s) x N in {args.instances}; "
          "target >= 1.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
