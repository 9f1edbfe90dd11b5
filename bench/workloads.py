"""Benchmark workloads: synthetic lengths, ShareGPT files, shared-prefix groups (all seeded)."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids (exact lengths) or text
    prompt_len: int
    output_len: int


def parse_dist(spec: str):
    """'fixed:N' | 'uniform:LO:HI' | 'normal:MEAN:STD[:MIN]' -> rng -> int (>= 1)."""
    kind, *args = spec.split(":")
    try:
        nums = [float(a) for a in args]
        if kind == "fixed" and len(nums) == 1:
            return lambda rng: max(1, int(nums[0]))
        if kind == "uniform" and len(nums) == 2:
            lo, hi = int(nums[0]), int(nums[1])
            if lo > hi:
                raise ValueError
            return lambda rng: max(1, rng.randint(lo, hi))
        if kind == "normal" and len(nums) in (2, 3):
            floor = int(nums[2]) if len(nums) == 3 else 1
            return lambda rng: max(floor, int(round(rng.gauss(nums[0], nums[1]))))
    except ValueError:
        pass
    raise ValueError(f"bad length distribution {spec!r}: use fixed:N, uniform:LO:HI or normal:MEAN:STD[:MIN]")


def synthetic(num_requests: int, input_len: str, output_len: str, vocab_size: int = 1000,
              seed: int = 0, first_token_id: int = 10) -> list[BenchRequest]:
    """Random token-id prompts of exact lengths (ids in [first_token_id, vocab_size))."""
    rng = random.Random(seed)
    pick_in, pick_out = parse_dist(input_len), parse_dist(output_len)
    out = []
    for _ in range(num_requests):
        n = pick_in(rng)
        out.append(BenchRequest([rng.randrange(first_token_id, vocab_size) for _ in range(n)], n, pick_out(rng)))
    return out


def shared_prefix(num_groups: int, requests_per_group: int, prefix_len: int, suffix_len: str,
                  output_len: str, vocab_size: int = 1000, seed: int = 0,
                  first_token_id: int = 10) -> list[BenchRequest]:
    """Groups of requests sharing a long system prompt, interleaved across groups."""
    rng = random.Random(seed)
    pick_suffix, pick_out = parse_dist(suffix_len), parse_dist(output_len)
    prefixes = [[rng.randrange(first_token_id, vocab_size) for _ in range(prefix_len)] for _ in range(num_groups)]
    out = []
    for _ in range(requests_per_group):
        for prefix in prefixes:
            suffix = [rng.randrange(first_token_id, vocab_size) for _ in range(pick_suffix(rng))]
            out.append(BenchRequest(prefix + suffix, len(prefix) + len(suffix), pick_out(rng)))
    return out


def relabel(requests: list[BenchRequest], seed: int, vocab_size: int = 1000,
            first_token_id: int = 10) -> list[BenchRequest]:
    """The same workload over other token ids: every id in [first_token_id, vocab_size) mapped
    through one seeded permutation. Lengths, order and shared prefixes stay as they were; no
    prefix of one relabelling is cached for another (configurations compared on one fleet see
    the same work, not another draw of it)."""
    ids = list(range(first_token_id, vocab_size))
    shuffled = ids[:]
    random.Random(seed).shuffle(shuffled)
    perm = dict(zip(ids, shuffled))
    return [BenchRequest([perm.get(t, t) for t in r.prompt], r.prompt_len, r.output_len) for r in requests]


def sharegpt(path: str, num_requests: int, tokenizer, seed: int = 0, max_len: int = 4096) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's token count as the output length."""
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        if not prompt or not reply:
            continue
        p_len, o_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply, add_special_tokens=False))
        if p_len < 4 or o_len < 4 or p_len + o_len > max_len:
            continue  # as vllm bench serve does: drop too short and too long pairs
        pairs.append(BenchRequest(prompt, p_len, o_len))
    if not pairs:
        raise ValueError(f"{path}: no usable conversations")
    rng = random.Random(seed)
    return [pairs[rng.randrange(len(pairs))] for _ in range(num_requests)]


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets in seconds for a Poisson process of `rate` requests/s (inf: all at once)."""
    if rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out
