"""`pdserve profile --quick` on a tiny model, and the cost-model fits against known coefficients."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from services.cli import main as pdserve
from services.planner.costmodel import (CELL_MIN_STEPS, StepCost, StepPoint, fit_quality, fit_step_cost,
                                        fit_transfer_cost)
from services.planner.profile_data import LLAMA3_8B, ModelShape, Profile, roofline_profile
from services.planner.profile_serve import (MAX_ROUNDS, ServeCost, ServePathError, calibrate_sustained,
                                            charge_router_cpu, engine_step, fit_serve_path, rounds_settled)
from services.planner.simulator import Fleet, simulate
from services.planner.workload import poisson
from sim_profiles import CPU_LIKE, profile


def test_step_fit_recovers_known_coefficients_and_knee():
    # Decode pairs at another price than prefill pairs (a CPU's decode kernel: ~2x).
    truth = StepCost(base=0.02, per_token=3e-4, per_attn=2e-8, per_decode_attn=5e-8, per_kv_token=1e-6,
                     per_seq=4e-4, knee_tokens=32)
    batches = ([[(n, 0)] for n in (8, 16, 64, 256, 1024, 2048)] + [[(n, 2048)] for n in (128, 1024)]
               + [[(1, c)] * b for b in (1, 4, 16, 64) for c in (128, 2048)] + [[(1, 128)] * 8 + [(512, 0)]])
    # Half the decode batches share one prompt's blocks (read once: kv smaller than the pairs say).
    points = [StepPoint.of(b, truth.batch_seconds(b) - (truth.per_kv_token * (len(b) - 1) * b[0][1]
                                                        if i % 2 and len(b) > 1 and b[0][0] == 1 else 0),
                           kv=b[0][1] + len(b) if i % 2 and len(b) > 1 and b[0][0] == 1 else None)
              for i, b in enumerate(batches)]
    fit = fit_step_cost(points)
    assert fit.knee_tokens == 32
    for name in ("base", "per_token", "per_attn", "per_decode_attn", "per_kv_token", "per_seq"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12), name


def test_pair_prices_split_by_rows_and_older_profiles_keep_one_price():
    step = StepCost(base=0.01, per_token=1e-4, per_attn=1e-7, per_decode_attn=3e-7, per_kv_token=0.0, per_seq=0.0)
    # A 64-token prefill chunk after 100 (pairs 64 x 132.5) beside two decodes at 300 and 500.
    chunks = [(64, 100), (1, 300), (1, 500)]
    point = StepPoint.of(chunks, 0.1)
    assert (point.attn, point.decode_attn) == (64 * 132.5, 301 + 501)
    assert step.batch_seconds(chunks) == pytest.approx(0.01 + 1e-4 * 66 + 1e-7 * 64 * 132.5 + 3e-7 * 802)
    assert step.decode_seconds(4, 1000) == pytest.approx(0.01 + 1e-4 * 4 + 3e-7 * 4 * 1001)
    # A profile written before the decode-pair price: every pair at per_attn, as it was fitted.
    old = {k: v for k, v in dataclasses.asdict(step).items() if k != "per_decode_attn"}
    assert StepCost(**old).per_decode_attn == 1e-7
    assert StepCost(**old).batch_seconds(chunks) == pytest.approx(0.01 + 1e-4 * 66 + 1e-7 * (64 * 132.5 + 802))
    with pytest.raises(ValueError, match=">= 0"):
        StepCost(base=0.01, per_token=0.0, per_attn=0.0, per_decode_attn=-1e-9, per_kv_token=0.0, per_seq=0.0)


def test_decode_steps_take_the_grids_measured_over_linear_per_batch_size():
    # A CPU's decode step bends with batch size where the linear terms cannot: batch 1 cheaper
    # than the line through the rest, batch 4 dearer. Prefills and mixed steps are linear.
    line = StepCost(base=0.012, per_token=6e-4, per_attn=3e-7, per_decode_attn=0.0, per_kv_token=1.5e-6,
                    per_seq=3e-5)
    bend = {1: 0.88, 2: 1.0, 4: 1.2, 16: 1.05}
    points = [StepPoint.of(b, line.batch_seconds(b)) for b in
              [[(n, 0)] for n in (16, 64, 256, 1024, 2048)] + [[(256, 2048)], [(1024, 2048)]]
              + [[(1, 128)] * 4 + [(256, 0)], [(1, 1024)] * 16 + [(1024, 0)]]]
    cells = {}
    for b, f in bend.items():
        for c in (128, 1024):
            # Six steps of a cell, each its own noise (the median is the cell's figure).
            secs = [line.decode_seconds(b, c) * f * n for n in (0.93, 1.0, 1.02, 1.04, 1.1, 0.97)]
            cells[b, c] = sorted(secs)[2:4]
            points += [StepPoint.of([(1, c)] * b, s) for s in secs]
    fit = fit_step_cost(points)
    assert [(b, c) for b, c, _ in fit.decode_correction] == sorted(cells)
    for (b, c), mid in cells.items():  # at a grid cell: that cell's median step
        assert fit.decode_seconds(b, c) == pytest.approx(sum(mid) / 2, rel=1e-9)
    # Between cells linear in context, then in batch; beyond the grid the edge's factor.
    f = {(b, c): fit.decode_factor(b, c) for b in (1, 2, 4, 16) for c in (128, 1024)}
    assert fit.decode_factor(3, 576) == pytest.approx(((f[2, 128] + f[2, 1024]) / 2 + (f[4, 128] + f[4, 1024]) / 2) / 2)
    assert fit.decode_factor(1, 4096) == pytest.approx(f[1, 1024]) and fit.decode_factor(64, 16) == pytest.approx(f[16, 128])
    assert fit.decode_factor(1, 576) < 1 < fit.decode_factor(4, 576)
    # Steps with a prefill chunk are the linear figure, corrected or not.
    for chunks in ([(512, 0)], [(1, 128)] * 4 + [(256, 0)]):
        assert fit.batch_seconds(chunks) == fit.linear_seconds(*_features(chunks))
    assert fit_quality(fit, points)["max_rel_error"] < fit_quality(dataclasses.replace(fit, decode_correction=()),
                                                                  points)["max_rel_error"]
    # The profile file keeps the cells; one without them (older, or a roofline) is the line alone.
    back = Profile.from_json(json.loads(json.dumps(dataclasses.replace(
        roofline_profile("h100", LLAMA3_8B), step=fit).to_json())))
    assert back.step == fit and back.step.decode_seconds(3, 700) == fit.decode_seconds(3, 700)
    plain = {k: v for k, v in dataclasses.asdict(fit).items() if k != "decode_correction"}
    assert StepCost(**plain).decode_seconds(4, 1024) == fit.linear_seconds(*_features([(1, 1024)] * 4))
    with pytest.raises(ValueError, match="factor > 0"):
        StepCost(**plain, decode_correction=[[4, 1024.0, 0.0]])


def test_a_decode_cell_needs_a_few_steps_to_correct_anything():
    line = StepCost(base=0.01, per_token=1e-4, per_attn=1e-7, per_kv_token=1e-6, per_seq=1e-4)
    points = [StepPoint.of(b, line.batch_seconds(b)) for b in [[(n, 0)] for n in (16, 64, 256, 1024)]]
    points += [StepPoint.of([(1, 512)] * 4, line.decode_seconds(4, 512) * 1.3) for _ in range(CELL_MIN_STEPS - 1)]
    points += [StepPoint.of([(1, 100)] * 2, line.decode_seconds(2, 100) * s) for s in (1.0, 1.1, 1.2)]
    fit = fit_step_cost(points)
    assert [(b, round(c)) for b, c, _ in fit.decode_correction] == [(2, 100)]


def _features(chunks):
    p = StepPoint.of(chunks, 1.0)
    return p.tokens, p.attn, p.kv, p.seqs, p.decode_attn


def test_transfer_fit_and_refusals():
    fit = fit_transfer_cost([1 << 20, 8 << 20, 64 << 20], [0.001 + s / 2e9 for s in (1 << 20, 8 << 20, 64 << 20)])
    assert fit.latency_s == pytest.approx(0.001) and fit.bytes_per_s == pytest.approx(2e9)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_transfer_cost([1, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="at least 6"):
        fit_step_cost([StepPoint(1, 1.0, 1, 1, 0.1)])


def test_profile_file_round_trip_and_version(tmp_path):
    prof = roofline_profile("h100", LLAMA3_8B)
    path = tmp_path / "p.json"
    prof.save(str(path))
    again = Profile.load(str(path))
    assert again.step == prof.step and again.transfers == prof.transfers and again.model == prof.model
    assert (again.neighbour_prefill, again.neighbour_decode) == (1.0, 1.0)  # GPUs do not share a device
    measured = dataclasses.replace(prof, neighbour_prefill=1.1, neighbour_decode=1.3, token_overhead_s=0.002)
    measured.save(str(path))
    again = Profile.load(str(path))
    assert (again.neighbour_prefill, again.neighbour_decode, again.token_overhead_s) == (1.1, 1.3, 0.002)
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version 99"):
        Profile.load(str(path))
    with pytest.raises(ValueError, match="not a pdserve profile"):
        Profile.from_json({"version": 1, "step": {}})


def test_roofline_profile_is_sane_for_llama3_8b():
    prof = roofline_profile("h100", LLAMA3_8B)
    assert 7.5e9 < LLAMA3_8B.num_params < 8.5e9
    assert LLAMA3_8B.kv_bytes_per_token == 128 * 1024
    decode = prof.step.decode_seconds(1, 1024)
    assert 0.005 < decode < 0.012  # a batch-1 step reads 16 GB of weights at ~2.3 TB/s
    # Below the knee a batch costs little more than one sequence, except reading its KV cache:
    # 64 x 1k tokens x 128 KiB = 8.6 GB, ~3.7 ms at 70% of 3.35 TB/s.
    assert prof.step.decode_seconds(64, 16) < 1.2 * prof.step.decode_seconds(1, 16)
    kv_read = 64 * 1025 * LLAMA3_8B.kv_bytes_per_token / (0.7 * 3.35e12)
    assert prof.step.decode_seconds(64, 1024) - prof.step.decode_seconds(64, 16) == pytest.approx(kv_read, rel=0.05)
    # A 2k prompt in ~70-120 ms: compute-bound past the knee.
    assert 0.05 < prof.step.prefill_seconds(2048, 8192) < 0.15
    assert roofline_profile("h200", LLAMA3_8B).step.decode_seconds(1, 1024) < decode


def test_pdserve_profile_roofline_writes_a_gpu_profile(tmp_path, capsys):
    out = tmp_path / "h200.json"
    assert pdserve(["profile", "--roofline", "h200", "--dtype", "bfloat16", "--max-num-batched-tokens", "8192",
                    "--out", str(out)]) == 0
    prof = Profile.load(str(out))
    assert prof.model == LLAMA3_8B and prof.source == "roofline:h200" and prof.max_num_batched_tokens == 8192
    assert prof.step == roofline_profile("h200", LLAMA3_8B, 8192).step
    assert "h200 roofline" in capsys.readouterr().out


def test_an_fp8_kv_cache_halves_the_bytes_a_plan_moves_and_reads(tmp_path, tiny_llama):
    """--kv-cache-dtype fp8: the profile's KV is a byte a value (transfers, decode reads); the
    weights keep the model's dtype."""
    out = tmp_path / "h200-fp8.json"
    assert pdserve(["profile", "--roofline", "h200", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
                    "--out", str(out)]) == 0
    fp8 = Profile.load(str(out))
    assert fp8.model == dataclasses.replace(LLAMA3_8B, kv_dtype_bytes=1)
    assert fp8.model.kv_bytes_per_token == LLAMA3_8B.kv_bytes_per_token // 2 and fp8.model.num_params == LLAMA3_8B.num_params
    bf16 = roofline_profile("h200", LLAMA3_8B)
    # A decode batch's cost over its contexts' KV: about half as much to read.
    ratio = ((fp8.step.decode_seconds(64, 4096) - fp8.step.decode_seconds(64, 16))
             / (bf16.step.decode_seconds(64, 4096) - bf16.step.decode_seconds(64, 16)))
    assert 0.45 < ratio < 0.56
    assert fp8.kv_bytes(1000) == bf16.kv_bytes(1000) // 2
    # Measured: the engine runs an fp8 cache, and its transfers move a byte a value.
    out = tmp_path / "cpu-fp8.json"
    assert pdserve(["profile", "--model", tiny_llama, "--quick", "--max-num-batched-tokens", "64",
                    "--no-serve-overhead", "--transports", "tcp", "--kv-cache-dtype", "fp8", "--out", str(out)]) == 0
    prof = Profile.load(str(out))
    assert prof.model.kv_dtype_bytes == 1 and prof.machine["kv_cache_dtype"] == "fp8"
    hf = json.loads((tmp_path.parent / tiny_llama).joinpath("config.json").read_text())
    assert prof.model.kv_bytes_per_token == ModelShape.from_hf_config(hf, 4).kv_bytes_per_token // 4
    assert [b for b, _ in prof.raw["transfer"]["tcp"]["points"]] == [
        n * 16 * prof.model.kv_bytes_per_token for n in (1, 8, 32)]


def test_pdserve_profile_quick_measures_through_the_engine(tiny_llama, tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = pdserve(["profile", "--model", tiny_llama, "--quick", "--max-num-batched-tokens", "64",
                  "--transports", "tcp,shm", "--out", str(out)])
    assert rc == 0
    prof = Profile.load(str(out))
    hf = json.loads((tmp_path.parent / tiny_llama).joinpath("config.json").read_text())
    assert prof.model == ModelShape.from_hf_config(hf, 4)
    assert prof.max_num_batched_tokens == 64 and prof.source == "measured"
    assert prof.machine["device"] == "cpu" and prof.machine["threads"] == 1 and prof.machine["torch"]
    points = prof.raw["step"]["points"]
    kinds = {p["kind"] for p in points}
    assert kinds == {"prefill", "chunk", "decode", "mixed"}
    # The quick grid's cases, as the engine's scheduler batched them:
    assert any(p["kind"] == "chunk" and p["tokens"] == 32 and p["kv"] == 64 + 32 for p in points)
    assert {p["seqs"] for p in points if p["kind"] == "decode"} == {1, 4, 8}
    assert any(p["kind"] == "prefill" and p["seqs"] == 2 and p["tokens"] == 32 for p in points)
    assert all(p["seconds"] > 0 for p in points)
    # Decode batches of distinct blocks (as requests are): 4 x 128 tokens read every context in
    # full (one prompt computed, three copies of its KV), and each row's pairs are decode pairs.
    four = [p for p in points if p["kind"] == "decode" and p["seqs"] == 4]
    assert min(p["kv"] for p in four) >= 4 * 129
    assert all(p["kv"] == p["decode_attn"] and p["attn"] == 0 for p in four)
    assert all(p["decode_attn"] > 0 and p["attn"] > 0 for p in points if p["kind"] == "mixed")
    assert all(p["kv"] == p["tokens"] for p in points if p["kind"] == "prefill")
    assert prof.raw["step"]["quality"]["num_points"] == len(points)
    # Each decode cell of the grid (three steps each) corrects the linear terms there, and says so.
    assert [b for b, _, _ in prof.step.decode_correction] == [1, 4, 8]
    assert "decode steps, measured over the linear terms: batch 1 x" in capsys.readouterr().out
    by_kind = prof.raw["step"]["quality"]["by_kind"]
    assert set(by_kind) == kinds and sum(q["num_points"] for q in by_kind.values()) == len(points)
    tcp = prof.transfer("tcp")
    assert tcp.bytes_per_s > 1e6  # loopback moves megabytes per second at the very least
    for transport in ("tcp", "shm"):
        assert [b for b, _ in prof.raw["transfer"][transport]["points"]] == [
            n * 16 * prof.model.kv_bytes_per_token for n in (1, 8, 32)]
    assert prof.transfer("shm").bytes_per_s > 1e6
    # The served path: requests one at a time through a router in front of a live instance on
    # these cores, at least four rounds of one per length, and a batch of 4 at once each round
    # (prompts of 16 tokens: the 64-token step computes all four, and they decode together).
    serve = prof.raw["serve"]["points"]
    rounds = len(serve) // 2
    assert 4 <= rounds <= 8 and [p["prompt"] for p in serve] == [128, 1024] * rounds
    # Where a busy machine never settles the batch's gaps, a quick profile keeps their medians
    # and says so in the file (a full profile fails instead).
    unsettled = prof.raw["serve"]["unsettled"]
    assert unsettled == "" or (rounds == 8 and "unsettled" in unsettled)
    assert all(p["tpot_s"] > 0 and p["step_s"] > 0 and p["batch"] == 1 for p in serve)
    batches = prof.raw["serve"]["batch_points"]
    assert len(batches) == rounds
    assert all(p["batch"] == 4 and p["prompt"] == 16 and p["gap_s"] > 0 for p in batches)
    # Over the engine's step: the quick grid measured no batch of 4 near 40 tokens, so the fit's.
    assert all(p["step_s"] == pytest.approx(prof.step.decode_seconds(4, 16 + 24)) and p["step_from"] == "fit"
               for p in batches)
    step_s, token_s = fit_serve_path(serve, batches)
    # With a core beside the instance, the router and the client ran there, outside its latency:
    # their CPU time per streamed token (48 tokens x 4 requests a batch) joins the per-token figure.
    assert all(p["tokens"] == 4 * 48 for p in batches)
    offcore = prof.offcore_token_s
    if (os.cpu_count() or 1) >= 2:
        # (/proc counts the router's CPU in 10 ms ticks: one batch may read 0, their sum may not.)
        assert all(p["client_cpu_s"] > 0 for p in batches) and sum(p["router_cpu_s"] for p in batches) > 0
        assert offcore == pytest.approx(sum(p["router_cpu_s"] + p["client_cpu_s"] for p in batches)
                                        / sum(p["tokens"] for p in batches))
        assert 0 < offcore < 0.05  # CPU milliseconds a token, not seconds
    else:
        assert offcore == 0
    # Sustained traffic: a closed loop of 4 in flight through the router, 24 requests of 8-16-token
    # prompts and 24-72 tokens out, each sent as one finished; the simulator replaying their
    # arrivals on the profile finds the per-token time lock-step batches missed.
    runs = prof.raw["serve"]["sustained_runs"]
    assert [r["concurrency"] for r in runs] == [4] and len(runs[0]["requests"]) == 24
    reqs = runs[0]["requests"]
    assert all(8 <= p <= 16 and 24 <= o <= 72 and t > 0 for _, p, o, t in reqs)
    assert len({o for _, _, o, _ in reqs}) > 1  # finishes stagger
    arrivals = [a for a, *_ in reqs]
    assert arrivals == sorted(arrivals) and max(arrivals[:4]) < min(arrivals[4:])  # 4 at once, then one per finish
    extra = prof.raw["serve"]["sustained_token_s"]
    found = prof.raw["serve"]["sustained_points"]
    assert len(found) == 1 and found[0]["concurrency"] == 4 and found[0]["token_s"] >= 0
    assert extra == pytest.approx(found[0]["token_s"])
    before = dataclasses.replace(prof, token_overhead_s=prof.token_overhead_s - extra)
    assert calibrate_sustained(before, runs)[0] == pytest.approx(extra, abs=2e-6)
    assert (prof.step_overhead_s, prof.token_overhead_s) == pytest.approx((step_s, token_s + offcore + extra))
    assert prof.raw["serve"]["router_token_s"] == offcore  # charged: bench-pd's fleets share the host
    # Each round again, fresh prompts, beside a busy neighbour instance on the next core.
    neighbour = prof.raw["serve"]["neighbour_points"]
    if (os.cpu_count() or 1) >= 2:
        assert len(neighbour) == 8 and not prof.raw["serve"]["neighbour_note"]
        assert all(p["tpot_busy_s"] > 0 and p["ttft_busy_s"] > 0 for p in neighbour)
        assert [p["tpot_alone_s"] for p in neighbour] == [p["tpot_s"] for p in serve]
        ratios = sorted(p["tpot_busy_s"] / p["tpot_alone_s"] for p in neighbour)
        assert prof.neighbour_decode == pytest.approx((ratios[3] + ratios[4]) / 2)
        long = sorted(p["ttft_busy_s"] / p["ttft_alone_s"] for p in neighbour if p["prompt"] == 1024)
        assert prof.neighbour_prefill == pytest.approx((long[1] + long[2]) / 2)
        # Fresh prompts beside the neighbour: computed again, not prefix-cache hits.
        assert prof.neighbour_prefill > 0.5
    else:  # one core: no room for a neighbour, and the file says so
        assert neighbour == [] and "not measured" in prof.raw["serve"]["neighbour_note"]
        assert (prof.neighbour_prefill, prof.neighbour_decode) == (1.0, 1.0)


def test_profile_grid_batches_fit_the_kv_cache_it_sizes():
    from services.planner.profile import _grid, _grid_steps, _kv_blocks

    grid = _grid(False, 2048, 4096)
    # Distinct-prompt decode batches up to 64 x 1k and 16 x 2k, every one within the cache.
    assert (64, 1024) in grid["decode"] and (16, 2048) in grid["decode"] and (64, 2048) not in grid["decode"]
    for block_size in (16, 32, 128):  # whatever the engine's block size, each batch fits whole
        blocks = _kv_blocks(_grid_steps(grid), block_size)
        # A batch's first sequence decodes one token while the copies of its KV load, then all
        # decode `steps` tokens.
        assert all(b * -(-(c + grid["steps"] + 2) // block_size) <= blocks for b, c in grid["decode"])
        assert blocks * block_size < 90_000 + 64 * block_size  # not the engine's whole memory
    assert all(c + 128 < 1024 for _, c in _grid(False, 2048, 1024)["decode"])


def test_a_profile_whose_cache_preempts_its_batch_refuses_to_fit_it(tiny_llama):
    from services.planner.profile import StepTimer

    # Two 128-token prompts fill 16 of 17 blocks; their next tokens need 18: one is preempted,
    # and the steps measured would be of one sequence where the grid says two.
    timer = StepTimer(tiny_llama, "cpu", 1, 256, 8, 512, "float32", kv_steps=[[17 * 16]])
    try:
        assert timer.core.kv_cache_manager.block_pool.num_blocks == 17
        timer.decode(2, 128, 3)
        with pytest.raises(RuntimeError, match="preempted"):
            timer.check_no_preemptions()
    finally:
        timer.core.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_decode_batch_computes_one_prompt_and_copies_its_kv_into_blocks_of_its_own(tiny_llama, device):
    from services.planner.profile import StepTimer

    timer = StepTimer(tiny_llama, device, 1, 64, 8, 512, "float32")
    try:
        sched = timer.core.scheduler
        seed = timer.add(100, 16)
        timer._compute_prompts()  # two 64-token steps
        copies = [timer.add(100, 16, clone_of=seed) for _ in range(3)]
        timer.step("load")
        # The step that loads the copies computes nothing of their prompts: the seed's token alone.
        assert timer.points[-1]["chunks"] == [(1, 100)]
        assert all(sched.requests[r].num_computed_tokens == 100 for r in copies)
        blocks = {r: sched.kv.get_block_ids(r) for r in [seed, *copies]}
        assert len({b for ids in blocks.values() for b in ids}) == sum(map(len, blocks.values()))  # none shared
        for r in copies:  # the prompt's 100 tokens (six blocks of 16 and 4), every layer, bit for bit
            for cache in timer.core.runner.kv_caches:
                assert torch.equal(cache[:, blocks[r][:6]], cache[:, blocks[seed][:6]])
                assert torch.equal(cache[:, blocks[r][6], :4], cache[:, blocks[seed][6], :4])
                assert cache[:, blocks[r][6], :4].abs().sum() > 0  # values, not the zeroed cache
            assert sched.requests[r].output_token_ids == [sched.requests[r].prompt_token_ids[-1]]
        timer.step("decode")  # a batch of four, each at its own blocks
        assert sorted(timer.points[-1]["chunks"]) == [(1, 100)] * 3 + [(1, 101)]
        assert timer.points[-1]["kv_read"] == 3 * 101 + 102
        with pytest.raises(ValueError, match="fewer than"):
            timer.add(200, 4, clone_of=seed)  # more prompt than the source has computed
        timer.drain()
        timer.check_no_preemptions()
    finally:
        timer.core.shutdown()


def _lone(gaps_ms, step_ms=20.0):
    return [{"batch": 1, "tpot_s": (step_ms + g) / 1e3, "step_s": step_ms / 1e3} for g in gaps_ms]


def _batches(gaps_ms, batch=16, step_ms=40.0):
    return [{"batch": batch, "gap_s": (step_ms + g) / 1e3, "step_s": step_ms / 1e3} for g in gaps_ms]


def test_served_path_fit_splits_a_step_cost_from_a_token_cost():
    # 1 ms a step + 0.5 ms a sampled token: lone requests 1.5 ms over the step model, a batch of
    # 16 9 ms (medians over noisy rounds).
    step_s, token_s = fit_serve_path(_lone([1.4, 1.5, 1.6, 1.5, 9.0]), _batches([8.8, 9.0, 9.3, 9.0]))
    assert (step_s, token_s) == pytest.approx((1e-3, 5e-4))


def test_served_path_fit_charges_a_batch_what_it_cost_when_a_lone_request_hides_in_noise():
    # The run that broke the sweep: a lone request's served TPOT within the step model's noise
    # (0 after the old clamp) while a batch of 16 paid 32 ms a step: ~2 ms a token, not 0.
    step_s, token_s = fit_serve_path(_lone([-0.5, -0.3, 0.2]), _batches([31.0, 32.0, 33.0]))
    assert step_s == 0 and token_s == pytest.approx(32e-3 * 16 / (1 + 16 * 16))
    # A batch costing no more than one request: all of it is per step.
    assert fit_serve_path(_lone([2.0]), _batches([1.0])) == pytest.approx((1.5e-3, 0.0))
    # No batch measured: the lone figure, as before.
    assert fit_serve_path(_lone([1.0, 3.0, 2.0]), []) == pytest.approx((0.0, 2e-3))


def test_served_path_fit_refuses_steps_faster_than_the_engines_beyond_noise():
    # A batch 5% under the engine's 40 ms step is noise (0 over it); 25% under refutes the points.
    assert fit_serve_path(_lone([1.0]), _batches([-2.0])) == pytest.approx((5e-4, 0.0))
    with pytest.raises(ServePathError, match="faster than the engine"):
        fit_serve_path(_lone([1.0]), _batches([-10.0, -9.0, -11.0]))
    with pytest.raises(ServePathError, match="lone requests"):
        fit_serve_path(_lone([-5.0, -6.0]), _batches([3.0]))
    # On a small model's 2 ms step the bound is a step's jitter, 0.5 ms, not 15% of it (0.3 ms):
    # the quick profile on a tiny checkpoint measured lone requests 0.35 ms under the engine's
    # 2.06 ms step on a busy 2-core box and refused itself.
    assert fit_serve_path(_lone([-0.35], step_ms=2.06), _batches([3.0])) == pytest.approx((0.0, 3e-3 * 16 / 257))
    with pytest.raises(ServePathError, match="lone requests stepped 0.60 ms faster"):
        fit_serve_path(_lone([-0.6], step_ms=2.06), _batches([3.0]))


def _loop_run(prof: Profile, extra_s: float, scale: float = 1.0) -> dict:
    """A closed loop's record as the profile writes it, its TPOTs what the simulator gives with
    `extra_s` more a token (x scale)."""
    wl = poisson(40.0, 96, "uniform:8:16", "uniform:24:72", seed=3)
    slow = dataclasses.replace(prof, token_overhead_s=prof.token_overhead_s + extra_s)
    traces = sorted(simulate(slow, Fleet(num_colocated=1), list(wl.requests)), key=lambda t: t.request.arrival)
    return {"concurrency": 16, "requests": [[t.request.arrival, t.request.isl, t.request.osl, t.tpot * scale]
                                            for t in traces]}


def test_served_rounds_go_on_until_the_batch_settles_and_only_a_quick_profile_keeps_unsettled_ones():
    def batches(gaps_ms):
        return [{"batch": 16, "gap_s": g / 1e3} for g in gaps_ms]

    settled = batches([40.0, 41.0, 40.5, 39.8])
    assert rounds_settled(settled[:3], 3) is None  # fewer than four rounds: go on
    assert rounds_settled(settled, 4) == ""
    noisy = batches([36.0, 72.0, 54.0, 38.0, 70.0, 60.0, 37.0, 55.0])
    assert rounds_settled(noisy[:5], 5) is None and rounds_settled(noisy[:5], 5, strict=False) is None
    with pytest.raises(ServePathError, match="too busy") as e:
        rounds_settled(noisy, MAX_ROUNDS)
    assert "36.0-72.0 ms a token over 8 rounds" in str(e.value)
    note = rounds_settled(noisy, MAX_ROUNDS, strict=False)
    assert "36.0-72.0 ms" in note and "unsettled" in note and "quick" in note
    # A millisecond step's jitter settles by the absolute bound (0.5 ms), not the relative one.
    assert rounds_settled(batches([2.0, 2.4, 2.1, 2.5]), 4) == ""


def test_sustained_calibration_finds_the_per_token_time_the_steps_lack():
    prof = profile(CPU_LIKE, token_overhead_s=1e-4)
    extra, found = calibrate_sustained(prof, [_loop_run(prof, 3e-4), _loop_run(prof, 5e-4)])
    assert [f["token_s"] for f in found] == pytest.approx([3e-4, 5e-4], abs=3e-6)
    assert extra == pytest.approx(4e-4, abs=3e-6)
    assert all(f["measured_tpot_s"] > f["simulated_tpot_s"] and f["requests"] == 96 for f in found)
    # Served faster than the simulator already says: nothing added (a profile is never made
    # faster than its steps), and the loop is recorded.
    extra, found = calibrate_sustained(prof, [_loop_run(prof, 0.0, scale=0.9)])
    assert extra == 0.0 and found[0]["token_s"] == 0.0 and found[0]["measured_tpot_s"] < found[0]["simulated_tpot_s"]
    assert calibrate_sustained(prof, []) == (0.0, [])
    # TPOTs no served path explains: the machine was busy; refused, not absorbed.
    with pytest.raises(ServePathError, match="too busy"):
        calibrate_sustained(prof, [_loop_run(prof, 0.0, scale=1000.0)])


def test_sustained_runs_survive_the_profile_file(tmp_path):
    run = {"concurrency": 4, "requests": [[0.0, 8, 24, 0.01], [0.2, 9, 30, 0.012]]}
    prof = profile(CPU_LIKE, token_overhead_s=3e-4, raw={"serve": {
        "sustained_token_s": 1e-4, "sustained_runs": [run],
        "sustained_points": [{"concurrency": 4, "requests": 2, "measured_tpot_s": 0.011, "simulated_tpot_s": 0.009,
                              "token_s": 1e-4}]}})
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = Profile.load(str(path))
    assert back.token_overhead_s == 3e-4
    for key in ("sustained_token_s", "sustained_runs", "sustained_points"):
        assert back.raw["serve"][key] == prof.raw["serve"][key]


def test_served_steps_are_measured_against_the_engines_own_step_of_that_batch():
    fit = StepCost(base=0.01, per_token=0, per_attn=0, per_kv_token=1e-6, per_seq=1e-3)
    # The profile's decode-only steps of 16 at 128-133 tokens (six steps of one batch), a 16-token
    # prompt computed alone, and 4 at 1k.
    measured = ([StepPoint.of([(1, 128 + i)] * 16, 0.017 + i * 1e-4) for i in range(6)]
                + [StepPoint.of([(16, 0)], 0.5), StepPoint.of([(1, 1024)] * 4, 0.03)])
    assert engine_step(measured, fit, 16, 152) == (pytest.approx(0.01725), "measured")
    # No measured step of that batch near that context: the fit's.
    assert engine_step(measured, fit, 16, 400) == (pytest.approx(fit.decode_seconds(16, 400)), "fit")
    assert engine_step(measured, fit, 8, 152) == (pytest.approx(fit.decode_seconds(8, 152)), "fit")
    assert engine_step(measured, fit, 4, 1048) == (0.03, "measured")


def test_a_profile_with_a_negative_serving_overhead_is_refused():
    prof = roofline_profile("h100", LLAMA3_8B)
    for field in ("token_overhead_s", "step_overhead_s"):
        with pytest.raises(ValueError, match="overheads must be >= 0"):
            dataclasses.replace(prof, **{field: -1e-3})


def test_the_routers_cpu_is_charged_only_where_it_would_land_on_instances():
    def cost():
        c = ServeCost(token_overhead_s=0.001)
        c.batch_points = [{"router_cpu_s": r, "client_cpu_s": 0.02, "tokens": 100} for r in (0.01, 0.03, 0.05)]
        return c

    beside = cost()  # ran on idle cores beside the instance; a fleet filling the host runs it on instances'
    charge_router_cpu(beside, offcore=True, router_elsewhere=False)
    assert beside.router_token_s == beside.offcore_token_s == pytest.approx(0.0005)
    assert beside.token_overhead_s == pytest.approx(0.0015)
    elsewhere = cost()  # --router-elsewhere: router pods on other hosts; measured, recorded, not charged
    charge_router_cpu(elsewhere, offcore=True, router_elsewhere=True)
    assert (elsewhere.router_token_s, elsewhere.offcore_token_s, elsewhere.token_overhead_s) == \
        pytest.approx((0.0005, 0.0, 0.001))
    shared = cost()  # ran on the instance's own cores: in its latency already
    charge_router_cpu(shared, offcore=False, router_elsewhere=False)
    assert (shared.router_token_s, shared.offcore_token_s, shared.token_overhead_s) == pytest.approx((0, 0, 0.001))
    unread = cost()  # /proc unreadable for the router: nothing to charge
    unread.batch_points[1]["router_cpu_s"] = None
    charge_router_cpu(unread, offcore=True, router_elsewhere=False)
    assert (unread.router_token_s, unread.token_overhead_s) == pytest.approx((0, 0.001))


def test_the_served_paths_cpu_set_reads_kernel_cpu_lists():
    from services.planner.profile_serve import _all_cpus, _cpu_list

    assert _cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert _cpu_list("5") == {5}
    with pytest.raises(ValueError):
        _cpu_list("\n")
    # Whatever the source, this process's own CPUs are among them.
    assert set(os.sched_getaffinity(0)) <= _all_cpus()
