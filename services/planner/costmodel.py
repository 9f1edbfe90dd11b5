"""Step and KV-transfer cost models fitted to measured points: what the simulator charges for each step.

Pure Python plus numpy for the fits; the simulator itself only evaluates them.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

FEATURES = ("base", "per_token", "per_attn", "per_decode_attn", "per_kv_token", "per_seq")


def attn_units(num_tokens: int, context: int) -> float:
    """Query-key pairs of `num_tokens` new tokens after `context` computed ones (causal): the
    attention work of a chunk, in tokens x tokens."""
    return num_tokens * (context + (num_tokens + 1) / 2.0)


def split_attn(chunks: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """(pairs of rows computing several tokens, pairs of one-token rows) of a step scheduling
    `chunks`: the two run different kernels (a prefill chunk's pairs are matmul work; a decode
    row reads its whole context for one query), so the cost model prices them apart."""
    many = one = 0.0
    for n, context in chunks:
        if n == 1:
            one += attn_units(1, context)
        else:
            many += attn_units(n, context)
    return many, one


@dataclass(frozen=True)
class StepCost:
    """Seconds for one engine step (schedule + forward + sample) of a batch:

        base + per_token * max(0, tokens - knee_tokens) + per_attn * attn
             + per_decode_attn * decode_attn + per_kv_token * kv + per_seq * seqs

    tokens: scheduled tokens (prefill chunks and decodes together); attn: sum of attn_units over
    the scheduled requests computing several tokens (prefill chunks, verified drafts: attention
    compute); decode_attn: the same over one-token rows (a decode row's query against its whole
    context: another kernel, another price per pair); kv: KV tokens the step reads from memory,
    each scheduled request's whole context once, blocks shared between requests once (what a
    decode batch pays on a GPU: attention there is bound by reading the cache); seqs: scheduled
    requests. `knee_tokens` is the roofline's flat part: on a GPU a step costs about the same up
    to a few hundred tokens (reading the weights dominates); on a CPU it is small.
    `per_decode_attn` left out (None; profiles written before it existed) means per_attn: one
    price for every pair, as those profiles were fitted.

    `decode_correction`: (batch, context, measured / linear) at the profile's decode-only grid
    cells. The linear terms cannot bend with batch size the way a CPU's kernels do (measured on
    this project's 2-core VM: batch 1 predicted ~10% high, batch 4 ~15% low, batch 32 ~6% high),
    so a decode-only step is the linear figure times the ratio interpolated from the cells
    (`decode_factor`), as Dynamo's planner corrects predicted ITL by measured over predicted.
    Empty (a roofline profile, one written before it existed): the linear figure."""
    base: float
    per_token: float
    per_attn: float
    per_kv_token: float
    per_seq: float
    knee_tokens: int = 0
    per_decode_attn: float | None = None
    decode_correction: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.per_decode_attn is None:
            object.__setattr__(self, "per_decode_attn", self.per_attn)
        if min(self.base, self.per_token, self.per_attn, self.per_decode_attn, self.per_kv_token,
               self.per_seq) < 0 or self.knee_tokens < 0:
            raise ValueError(f"step cost coefficients must be >= 0: {self}")
        cells = tuple(sorted((int(b), float(c), float(f)) for b, c, f in self.decode_correction))
        if any(b < 1 or c < 0 or not f > 0 for b, c, f in cells):
            raise ValueError(f"decode correction cells are (batch >= 1, context >= 0, factor > 0): {cells}")
        object.__setattr__(self, "decode_correction", cells)

    def linear_seconds(self, tokens: int, attn: float, kv: int, seqs: int, decode_attn: float = 0.0) -> float:
        """The fitted linear terms alone (no decode correction)."""
        return (self.base + self.per_token * max(0, tokens - self.knee_tokens) + self.per_attn * attn
                + self.per_decode_attn * decode_attn + self.per_kv_token * kv + self.per_seq * seqs)

    def seconds(self, tokens: int, attn: float, kv: int, seqs: int, decode_attn: float = 0.0) -> float:
        s = self.linear_seconds(tokens, attn, kv, seqs, decode_attn)
        if self.decode_correction and attn == 0 and tokens == seqs > 0 and decode_attn > 0:
            # decode_attn of one-token rows is the sum of (context + 1): the batch's mean context.
            s *= self.decode_factor(seqs, decode_attn / seqs - 1)
        return s

    def decode_factor(self, batch: int, context: float) -> float:
        """measured / linear for a decode-only step of `batch` sequences at `context` tokens each:
        linear in context between a profiled batch size's cells, then linear in batch between
        the two profiled sizes around it; outside the grid, the nearest edge's. 1.0 without cells."""
        by_batch = self._cells_by_batch
        if not by_batch:
            return 1.0
        return _interp(float(batch), [(float(b), _interp(context, cells)) for b, cells in by_batch.items()])

    @functools.cached_property
    def _cells_by_batch(self) -> dict[int, list[tuple[float, float]]]:
        """decode_correction grouped by batch size, sizes ascending, contexts ascending (the
        cells are sorted): built once, read at every decode-only step the simulator prices."""
        by_batch: dict[int, list[tuple[float, float]]] = {}
        for b, c, f in self.decode_correction:
            by_batch.setdefault(b, []).append((c, f))
        return by_batch

    def batch_seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        """A step scheduling `chunks`: (new tokens, tokens already computed) per request."""
        attn, decode_attn = split_attn(chunks)
        return self.seconds(sum(n for n, _ in chunks), attn, sum(c + n for n, c in chunks), len(chunks),
                            decode_attn)

    def prefill_seconds(self, prompt_tokens: int, chunk: int) -> float:
        """A whole prompt alone on an instance, in chunks of at most `chunk` tokens."""
        total, done = 0.0, 0
        while done < prompt_tokens:
            n = min(chunk, prompt_tokens - done)
            total += self.batch_seconds([(n, done)])
            done += n
        return total

    def decode_seconds(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences of `context` tokens each."""
        return self.seconds(batch, 0.0, batch * (context + 1), batch, batch * attn_units(1, context))


def _interp(x: float, table: Sequence[tuple[float, float]]) -> float:
    """Piecewise-linear through (x, y) sorted by x, flat beyond both ends."""
    if x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return table[-1][1]


@dataclass(frozen=True)
class TransferCost:
    """Seconds to pull `nbytes` of KV: latency (control round trips) + bytes / bandwidth."""
    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bytes_per_s <= 0:
            raise ValueError(f"transfer cost needs latency >= 0 and bandwidth > 0: {self}")

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


def _nnls(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares for a handful of columns: the best of every column subset's
    unconstrained fit whose coefficients are all >= 0 (exact; 2^6 small solves)."""
    best, best_sse = np.zeros(x.shape[1]), float(np.sum(y * y))
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            sse = float(np.sum((x[:, cols] @ coef - y) ** 2))
            if sse < best_sse:
                best_sse = sse
                best = np.zeros(x.shape[1])
                best[list(cols)] = coef
    return best, best_sse


@dataclass(frozen=True)
class StepPoint:
    """One measured step: what it scheduled and how long it took."""
    tokens: int
    attn: float
    kv: int
    seqs: int
    seconds: float
    decode_attn: float = 0.0

    @classmethod
    def of(cls, chunks: Sequence[tuple[int, int]], seconds: float, kv: int | None = None) -> "StepPoint":
        """kv: KV tokens read, where requests share blocks (default: every context in full)."""
        attn, decode_attn = split_attn(chunks)
        return cls(sum(n for n, _ in chunks), attn, sum(c + n for n, c in chunks) if kv is None else kv,
                   len(chunks), seconds, decode_attn)


KNEES = (0, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# A decode grid cell's steps: contexts within this ratio of the previous are one cell, and a
# cell needs this many steps for its median to be worth more than the linear fit.
CELL_SPREAD, CELL_MIN_STEPS = 1.25, 3


def fit_step_cost(points: Sequence[StepPoint], knees: Sequence[int] = KNEES) -> StepCost:
    """Least squares on relative error (each point weighted by 1/time, so that 10 ms decode steps
    count as much as 2 s prefills), coefficients kept >= 0; the knee is the candidate that fits
    best (small batches cost one read of the weights whatever their size: CPUs have a knee too)."""
    if len(points) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(points)}")
    y = np.array([p.seconds for p in points])
    if np.any(y <= 0):
        raise ValueError("measured step times must be > 0")
    w = 1.0 / y
    best: tuple[float, StepCost] | None = None
    for knee in knees:
        x = np.array([[1.0, max(0, p.tokens - knee), p.attn, p.decode_attn, p.kv, p.seqs] for p in points])
        coef, sse = _nnls(x * w[:, None], y * w)
        cost = StepCost(knee_tokens=int(knee), **{f: float(c) for f, c in zip(FEATURES, coef)})
        if best is None or sse < best[0]:
            best = (sse, cost)
    return dataclasses.replace(best[1], decode_correction=decode_cells(best[1], points))


def decode_cells(cost: StepCost, points: Sequence[StepPoint]) -> tuple[tuple[int, float, float], ...]:
    """(batch, median context, median measured / linear) for each cell of decode-only steps:
    points of one batch size whose contexts lie within CELL_SPREAD of each other, at least
    CELL_MIN_STEPS of them (the median of a handful of steps, not one step's noise)."""
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for p in points:
        if p.attn == 0 and p.tokens == p.seqs > 0 and p.decode_attn > 0:
            ratio = p.seconds / cost.linear_seconds(p.tokens, p.attn, p.kv, p.seqs, p.decode_attn)
            by_batch.setdefault(p.seqs, []).append((p.decode_attn / p.seqs - 1, ratio))
    cells = []
    for b, pts in sorted(by_batch.items()):
        pts.sort()
        group = [pts[0]]
        for c, r in pts[1:] + [(math.inf, 0.0)]:
            if c <= group[-1][0] * CELL_SPREAD:
                group.append((c, r))
                continue
            if len(group) >= CELL_MIN_STEPS:
                cells.append((b, statistics.median(g[0] for g in group), statistics.median(g[1] for g in group)))
            group = [(c, r)]
    return tuple(cells)


def fit_transfer_cost(sizes: Sequence[int], seconds: Sequence[float]) -> TransferCost:
    """Straight line through (bytes, seconds), intercept and slope kept >= 0."""
    if len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("need transfers of at least two different sizes to fit")
    x = np.array([[1.0, float(s)] for s in sizes])
    coef, _ = _nnls(x, np.array(seconds, dtype=float))
    slope = coef[1] if coef[1] > 0 else 1e-12  # a flat line: bandwidth not resolved, say so loudly
    return TransferCost(latency_s=float(coef[0]), bytes_per_s=1.0 / slope)


def relative_errors(cost: StepCost, points: Sequence[StepPoint]) -> list[float]:
    return [cost.seconds(p.tokens, p.attn, p.kv, p.seqs, p.decode_attn) / p.seconds - 1.0 for p in points]


def fit_quality(cost: StepCost, points: Sequence[StepPoint]) -> dict:
    """Median and worst absolute relative error of the fit on its own points."""
    errs = sorted(abs(e) for e in relative_errors(cost, points))
    return {"median_rel_error": errs[len(errs) // 2] if errs else math.nan,
            "max_rel_error": errs[-1] if errs else math.nan, "num_points": len(errs)}

