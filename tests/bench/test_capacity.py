"""bench/capacity.py: the capacity ladder (DistServe's goodput), against fake fleets of known capacity."""
from __future__ import annotations

from bench import capacity


def _rungs(capacity: float, base: float = 1.0, factor: float = 1.2):
    """A fake fleet: rung k (rate base x factor^k) is all in SLO up to `capacity`, then half."""
    ran = []

    def run_rung(k):
        rate = base * factor ** k
        ran.append(k)
        return {"rate": rate, "slo_attainment": 1.0 if rate <= capacity + 1e-9 else 0.5}
    return run_rung, ran


def find_capacity(run_rung, target: float, max_up: int, max_down: int, refine: int = 0) -> capacity.Ladder:
    """One search alone, through `interleave` as bench-pd's sweep runs them."""
    return capacity.interleave({"one": capacity.search(target, max_up, max_down, refine)},
                               lambda _, k: run_rung(k))["one"]


def test_capacity_ladder_climbs_until_a_rung_fails():
    run, ran = _rungs(capacity=1.2 ** 3)
    lad = find_capacity(run, 0.9, max_up=6, max_down=6)
    assert ran == [0, 1, 2, 3, 4]
    assert abs(lad.capacity - 1.2 ** 3) < 1e-9 and lad.bounded


def test_capacity_ladder_descends_when_the_cells_rate_fails():
    run, ran = _rungs(capacity=1.2 ** -2)
    lad = find_capacity(run, 0.9, max_up=6, max_down=6)
    assert ran == [0, -1, -2]
    assert abs(lad.capacity - 1.2 ** -2) < 1e-9 and lad.bounded


def test_capacity_ladder_says_when_it_is_only_a_lower_bound_or_nothing_passed():
    run, ran = _rungs(capacity=100.0)
    lad = find_capacity(run, 0.9, max_up=2, max_down=6)
    assert ran == [0, 1, 2] and not lad.bounded and abs(lad.capacity - 1.44) < 1e-9
    run, ran = _rungs(capacity=0.01)
    lad = find_capacity(run, 0.9, max_up=2, max_down=3)
    assert ran == [0, -1, -2, -3] and lad.capacity == 0.0


def test_a_rung_lasts_its_seconds_at_its_rate():
    # An overloaded fleet's queue grows by the excess rate: a rung is sized by time, not count.
    assert capacity.rung_size(5.0, 60.0, 20) == 300
    assert capacity.rung_size(0.1, 60.0, 20) == 20
    assert capacity.rung_size(2.01, 10.0, 1) == 21


def test_refining_bisects_between_the_last_passing_and_the_first_failing_rung():
    # Capacity 1.2^2.6: the ladder brackets it between rungs 2 and 3, then halves the gap twice.
    run, ran = _rungs(capacity=1.2 ** 2.6)
    lad = find_capacity(run, 0.9, max_up=6, max_down=6, refine=2)
    assert ran == [0, 1, 2, 3, 2.5, 2.75]
    assert abs(lad.capacity - 1.2 ** 2.5) < 1e-9 and lad.bounded
    run, ran = _rungs(capacity=1.2 ** -1.3)  # descending: between rungs -2 and -1
    lad = find_capacity(run, 0.9, max_up=6, max_down=6, refine=1)
    assert ran == [0, -1, -2, -1.5]
    assert abs(lad.capacity - 1.2 ** -1.5) < 1e-9 and lad.bounded


def test_refining_needs_a_bracket():
    # Nothing failed above (a lower bound) or nothing passed: no bisection to run.
    run, ran = _rungs(capacity=100.0)
    assert not find_capacity(run, 0.9, max_up=2, max_down=6, refine=3).bounded and ran == [0, 1, 2]
    run, ran = _rungs(capacity=0.01)
    assert find_capacity(run, 0.9, max_up=2, max_down=1, refine=3).capacity == 0.0 and ran == [0, -1]


def test_interleaved_searches_take_turns_and_each_finds_its_own_capacity():
    fleets = {"a": _rungs(capacity=1.2 ** 2), "b": _rungs(capacity=1.2 ** -1), "c": _rungs(capacity=1.2 ** 1.7)}
    order = []

    def run(name, k):
        order.append(name)
        return fleets[name][0](k)

    def next_round(r):
        order.append(f"round {r}")
    ladders = capacity.interleave({n: capacity.search(0.9, max_up=6, max_down=6, refine=1) for n in fleets}, run,
                                  before_round=next_round)
    rounds = [i for i, x in enumerate(order) if x.startswith("round")]
    assert [order[i] for i in rounds] == ["round 0", "round 1", "round 2", "round 3", "round 4"]
    order = [x for x in order if not x.startswith("round")]
    assert {n: round(lad.capacity, 9) for n, lad in ladders.items()} == {
        "a": round(1.2 ** 2, 9), "b": round(1.2 ** -1, 9), "c": round(1.2 ** 1.5, 9)}
    assert fleets["a"][1] == [0, 1, 2, 3, 2.5] and fleets["b"][1] == [0, -1, -0.5] and fleets["c"][1] == [0, 1, 2, 1.5]
    # Round by round, every unfinished search runs one rung; each round starts one search later.
    assert order[:3] == ["a", "b", "c"] and order[3:6] == ["b", "c", "a"] and order[6:9] == ["c", "a", "b"]
    assert order[9:] == ["c", "a", "a"]  # b finished after three rungs, c after four
