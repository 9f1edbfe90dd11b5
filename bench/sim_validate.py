"""The simulator against the real thing: bench-pd's configurations run for real and simulated from a fresh profile.

For each configuration bench-pd measures (disaggregated 1P+1D over tcp, colocated x2, one core
each) and each rate: the same requests (bench-pd's prompts and Poisson arrivals, same seeds) sent
to the real services, and given to the simulator with a profile measured here just before (one
thread, pinned to core 0, bench-pd's model); prints predicted against measured TTFT and TPOT
p50/p90 with the relative error. Target: every |error| <= 20%.

    python -m bench.sim_validate [--quick] [--profile FILE] [--rates 0.1,0.2,0.3]

Measure on a quiet machine: anything else on the cores skews both sides differently. A machine
whose speed moves during the run (this VM's has moved 2x from one day to the next) skews them too:
each configuration runs a lone probe request (1,024 prompt tokens, 64 out) before and after its
rates, and the run prints the probe's TPOT against the profile's prediction and the largest drift.

Beside the raw error it prints the error of the predictions corrected as `pdserve planner --mode
sla` corrects its own (measured / predicted): every cell's TTFT times the first probe's measured
over predicted TTFT, its TPOT times the probe's TPOT ratio. That takes out how far the machine's
speed moved between the profile and the configuration's run (one factor per configuration,
measured before its rates from one lone request, never from the cells it is compared with); what
is left is the simulator's own error under load. The target stays on the raw figure.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.metrics import parse_slos  # noqa: E402
from bench.pd_bench import BUILD, ensure_model, start_pdserve  # noqa: E402
from bench.procs import allowed_cpus, exit_on_signals, pdserve_cmd  # noqa: E402
from bench.serve import run_benchmark  # noqa: E402
from bench.workloads import poisson_arrivals, synthetic  # noqa: E402
from services.planner.profile_data import Profile  # noqa: E402
from services.planner.sim_metrics import summarize  # noqa: E402
from services.planner.simulator import Fleet, SimRequest, simulate  # noqa: E402
from services.planner.sla import correction_factor  # noqa: E402

FLEETS = {"disaggregated": Fleet(num_prefill=1, num_decode=1, transport="tcp"), "colocated": Fleet(num_colocated=2)}
KEYS = [("TTFT p50", "p50_ttft_ms"), ("TTFT p90", "p90_ttft_ms"), ("TPOT p50", "p50_tpot_ms"), ("TPOT p90", "p90_tpot_ms")]
ARRIVAL_SEED = 1  # bench-pd's run_benchmark(..., seed=1)


def fresh_profile(model: str, quick: bool, out: str, threads: int = 1) -> Profile:
    """`pdserve profile` in a process of its own on the first `threads` cores with that many torch
    threads (bench-pd's services: one). Not in this process: threads made while it was pinned
    to one core would stay there, and a second, wider profile would measure them crowded."""
    import subprocess

    cores = allowed_cpus()[:threads]
    preexec = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    cmd = pdserve_cmd("profile", "--model", model, "--num-threads", str(threads), "--transports", "tcp",
                      "--max-model-len", "4096", "--out", out, *(["--quick"] if quick else []))
    subprocess.run(cmd, check=True, preexec_fn=preexec, stdout=subprocess.DEVNULL)
    return Profile.load(out)


def sim_requests(reqs, rate: float) -> list[SimRequest]:
    return [SimRequest(a, r.prompt_len, r.output_len)
            for a, r in zip(poisson_arrivals(len(reqs), rate, ARRIVAL_SEED), reqs)]


def compare(name: str, rate: float, measured: dict, predicted: dict) -> list[float]:
    errors = []
    cells = []
    for label, key in KEYS:
        m, p = measured[key], predicted[key]
        err = p / m - 1 if m > 0 else float("nan")
        errors.append(err)
        cells.append(f"{label} {p:8.0f} / {m:8.0f} ms ({100 * err:+5.0f}%)")
    print(f"{name:<14}{rate:>6g}  " + "  ".join(cells), flush=True)
    return errors


PROBE = ("fixed:1024", "fixed:64")  # the drift probe: one request alone on the fleet


def probe_requests(lengths: tuple[str, str] = PROBE) -> tuple[list, list, list]:
    """The probe's warm-up, first and last requests: one each, the probe's lengths, each its own
    prompt (a repeat would hit the prefix cache, and its TTFT would measure no prefill)."""
    return tuple(synthetic(1, *lengths, vocab_size=4000, seed=seed) for seed in (99, 100, 101))


def drift(predicted_ms: float, before_ms: float, after_ms: float) -> tuple[float, str]:
    """The machine's drift as a lone request's TPOT sees it: the largest relative move, between the
    two probes or from the profile's prediction to either, and a line saying so."""
    moves = [after_ms / before_ms - 1, before_ms / predicted_ms - 1, after_ms / predicted_ms - 1]
    worst = max(moves, key=abs)
    return worst, (f"lone-request TPOT {predicted_ms:.1f} ms predicted, {before_ms:.1f} measured before the "
                   f"rates, {after_ms:.1f} after (drift {100 * worst:+.0f}%)")


def probe_correction(predicted: dict, measured: dict) -> tuple[float, float]:
    """(TTFT, TPOT) factors, measured over predicted, of the lone probe, by the planner's SLA mode's
    own rule (correction_factor: within its limits)."""
    return tuple(correction_factor(measured[key], predicted[key]) for key in ("p50_ttft_ms", "p50_tpot_ms"))


def corrected(predicted: dict, factors: tuple[float, float]) -> dict:
    """The prediction's TTFT and TPOT percentiles times the probe's factors."""
    c_ttft, c_tpot = factors
    return {key: predicted[key] * (c_ttft if "ttft" in key else c_tpot) for _, key in KEYS}


def per_request(measured: dict, traces) -> None:
    """Each request's TTFT, predicted against measured, with where the simulator sent it: which
    requests make a percentile's error."""
    for k, (trace, ttft) in enumerate(zip(traces, measured["ttfts"])):
        r = trace.request
        where = "+".join(n for n in (trace.prefill_instance, trace.decode_instance) if n)
        print(f"    request {k:3d} at {r.arrival:7.1f} s  {r.isl:5d} in {r.osl:4d} out  {where:<20} "
              f"TTFT {1e3 * trace.ttft:7.0f} / {1e3 * ttft:7.0f} ms ({100 * (trace.ttft / ttft - 1):+5.0f}%)",
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quick profile, one rate, 4 requests: checks the "
                                                         "harness, not the simulator's accuracy")
    ap.add_argument("--profile", default=None, help="use this profile instead of measuring one now")
    ap.add_argument("--rates", default="0.1,0.2,0.3")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--input-len", default="uniform:1024:2048")
    ap.add_argument("--output-len", default="uniform:64:128")
    ap.add_argument("--configs", default="disaggregated,colocated")
    ap.add_argument("--max-error", type=float, default=0.2)
    ap.add_argument("--per-request", action="store_true",
                    help="print every request's TTFT, predicted / measured, and the instance it was simulated on")
    args = ap.parse_args(argv)
    if args.quick:
        args.rates, args.num_prompts = "0.3", 4
    out_dir = os.path.join(BUILD, "sim-validate")
    os.makedirs(out_dir, exist_ok=True)
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    model = ensure_model()
    prof = Profile.load(args.profile) if args.profile else fresh_profile(
        model, args.quick, os.path.join(out_dir, "profile.json"))
    s = prof.step
    print(f"profile ({prof.source}): step {s.base * 1e3:.1f} ms + {s.per_token * 1e6:.0f} us/token + "
          f"{s.per_attn * 1e9:.2f} ns/prefill pair + {s.per_decode_attn * 1e9:.2f} ns/decode pair + "
          f"{s.per_kv_token * 1e9:.0f} ns/KV token + {s.per_seq * 1e6:.0f} us/seq; "
          f"knee {s.knee_tokens}; served path +{prof.step_overhead_s * 1e3:.2f} ms/step +{prof.token_overhead_s * 1e3:.2f} ms/token; busy neighbour "
          f"x{prof.neighbour_prefill:.2f} prefill, x{prof.neighbour_decode:.2f} decode", flush=True)
    rates = [float(r) for r in args.rates.split(",")]
    slos = parse_slos(["ttft:4000", "tpot:100"])
    # bench-pd's requests exactly: fresh prompts per rate (seed i + 1), same arrivals (seed 1).
    workloads = {rate: synthetic(args.num_prompts, args.input_len, args.output_len, vocab_size=4000, seed=i + 1)
                 for i, rate in enumerate(rates)}
    warmup = synthetic(2, "fixed:64", "fixed:8", vocab_size=4000, seed=0)
    warm_probe, probe, last_probe = probe_requests()
    worst = worst_drift = worst_corrected = 0.0
    print(f"\n{'config':<14}{'rate':>6}  predicted / measured (error)", flush=True)
    for name in args.configs.split(","):
        cfg, url = start_pdserve(name, model, logs, name == "disaggregated", [])
        try:
            asyncio.run(run_benchmark(url, None, warmup, progress=False))
            asyncio.run(run_benchmark(url, None, warm_probe, progress=False))  # warms the probe's shapes up
            first = asyncio.run(run_benchmark(url, None, probe, progress=False))
            before = first["p50_tpot_ms"]
            lone = summarize(simulate(prof, FLEETS[name], sim_requests(probe, 1.0)))
            factors = probe_correction(lone, first)
            print(f"{name:<14}{'probe':>6}  lone request TTFT {lone['p50_ttft_ms']:.0f} ms predicted, "
                  f"{first['p50_ttft_ms']:.0f} measured; TPOT {lone['p50_tpot_ms']:.1f} ms predicted, {before:.1f} "
                  f"measured: corrections TTFT x{factors[0]:.2f}, TPOT x{factors[1]:.2f}", flush=True)
            for rate in rates:
                measured = asyncio.run(run_benchmark(url, None, workloads[rate], rate=rate, slos=slos,
                                                     seed=ARRIVAL_SEED, progress=False))
                if measured["failed"]:
                    print(f"{name} @ {rate:g}: {measured['failed']} requests failed: {measured['errors']}")
                    return 1
                traces = simulate(prof, FLEETS[name], sim_requests(workloads[rate], rate))
                predicted = summarize(traces, {k: v for k, v in slos.items() if k in ("ttft", "tpot")})
                errors = compare(name, rate, measured, predicted)
                if args.per_request:
                    per_request(measured, traces)
                worst = max([worst, *(abs(e) for e in errors)])
                errors = compare("  corrected", rate, measured,
                                 corrected(predicted, factors))
                worst_corrected = max([worst_corrected, *(abs(e) for e in errors)])
            after = asyncio.run(run_benchmark(url, None, last_probe, progress=False))["p50_tpot_ms"]
            moved, line = drift(lone["p50_tpot_ms"], before, after)
            worst_drift = max(worst_drift, abs(moved))
            print(f"{name:<14}{'probe':>6}  {line}", flush=True)
        finally:
            cfg.stop()
    print(f"\nsim_max_rel_error={worst:.3f}  (target <= {args.max_error:g})")
    print(f"sim_max_rel_error_corrected={worst_corrected:.3f}  (predictions x the first probe's measured/predicted "
          f"TTFT and TPOT, one pair per configuration, as the planner's SLA mode corrects them)")
    print(f"machine_drift={worst_drift:.3f}  (the probes' largest move: errors of that size may be the "
          f"machine's, not the simulator's)")
    if args.quick:
        print("(--quick: a rough profile and 4 requests; the error says nothing about the simulator)")
        return 0
    return 0 if worst <= args.max_error else 1


if __name__ == "__main__":
    exit_on_signals()  # SIGTERM stops the stack this started, too
    sys.exit(main())
