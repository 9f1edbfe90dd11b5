"""Step and KV-transfer cost models fitted to measured points: what the simulator charges for each step.

Pure Python plus numpy for the fits; the simulator itself only evaluates them.
"""
from __future__ import annotations

import itertools
import math
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
    price for every pair, as those profiles were fitted."""
    base: float
    per_token: float
    per_attn: float
    per_kv_token: float
    per_seq: float
    knee_tokens: int = 0
    per_decode_attn: float | None = None

    def __post_init__(self) -> None:
        if self.per_decode_attn is None:
            object.__setattr__(self, "per_decode_attn", self.per_attn)
        if min(self.base, self.per_token, self.per_attn, self.per_decode_attn, self.per_kv_token,
               self.per_seq) < 0 or self.knee_tokens < 0:
            raise ValueError(f"step cost coefficients must be >= 0: {self}")

    def seconds(self, tokens: int, attn: float, kv: int, seqs: int, decode_attn: float = 0.0) -> float:
        return (self.base + self.per_token * max(0, tokens - self.knee_tokens) + self.per_attn * attn
                + self.per_decode_attn * decode_attn + self.per_kv_token * kv + self.per_seq * seqs)

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
    return best[1]


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

