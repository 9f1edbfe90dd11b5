"""A discrete-event simulator of a pdserve fleet: router, prefill and decode pools, KV pulls, colocated instances.

Each instance runs the engine scheduler's rules (engine/scheduler.py) on simulated time: running
requests first, each taking what it still has to compute within the step's token budget
(max_num_batched_tokens), then the FCFS waiting queue while budget and seats (max_num_seqs) last,
the last prompt chunked to fit; a decode admits a request whose KV is remote with a seat and no
budget, pulls it (the transfer), and runs it from the next step after the pull completes. A step
costs what the profile's StepCost says for exactly the batch it scheduled. The router sends each
request to the instance with the fewest outstanding tokens (ties in turn), as least_load does;
in P/D the first token comes from the prefill and the request then goes to the least-loaded
decode, which pulls its KV. Instances share hosts as on the profiled machine (a CPU profile: its
cores over an instance's width, filled in order, prefills first): a step that starts while another
instance on its host is busy costs the profile's neighbour factor more. The serving path's work a
token is charged to the step that samples it, except the router's and client's CPU
(offcore_token_s), which takes the step's time only when every core of its host is stepping: with
one free (an idle neighbour, a host the fleet does not fill) it runs there (its load on that core
is not modelled: an idle core takes it at no cost). Not modelled: the KV cache's size (no
preemption), prefix-cache hits, retries and migration, and the age of the router's load reports:
the simulator reads every instance's outstanding tokens at each arrival, the router the engine's
count at its last poll (every 0.5 s, as of the engine's last step) plus what it routed there
since, so work that finished since the poll is still counted there.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from services.planner.profile_data import Profile


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds from the start
    isl: int  # prompt tokens
    osl: int  # output tokens, all generated (as bench's ignore_eos + min_tokens)

    def __post_init__(self) -> None:
        if self.arrival < 0 or self.isl < 1 or self.osl < 1:
            raise ValueError(f"a request needs arrival >= 0, isl >= 1 and osl >= 1: {self}")


@dataclass(frozen=True)
class Fleet:
    """Instances of each role, all alike (one profile); P/D needs both pools, colocated neither."""
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    transport: str = "tcp"
    max_num_batched_tokens: int | None = None  # None: the profile's
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        pd = self.num_prefill or self.num_decode
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 0:
            raise ValueError("instance counts must be >= 0")
        if pd and self.num_colocated:
            raise ValueError("a fleet is either disaggregated (prefill + decode) or colocated, not both")
        if pd and not (self.num_prefill and self.num_decode):
            raise ValueError("a disaggregated fleet needs at least one prefill and one decode instance")
        if not pd and not self.num_colocated:
            raise ValueError("a fleet needs instances")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def name(self) -> str:
        return f"{self.num_prefill}P+{self.num_decode}D" if self.disaggregated else f"{self.num_colocated}C"


@dataclass
class RequestTrace:
    """What the client of one request saw (engine times + the profile's request overhead)."""
    request: SimRequest
    token_times: list[float] = field(default_factory=list)  # absolute, first token first
    prefill_instance: str = ""
    decode_instance: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.request.arrival

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def finished(self) -> bool:
        return len(self.token_times) == self.request.osl


class _Seq:
    """One request on one instance: computed tokens catching up to known tokens."""
    __slots__ = ("trace", "known", "computed", "remote", "budget")

    def __init__(self, trace: RequestTrace, known: int, remote: bool, budget: int) -> None:
        self.trace, self.known, self.computed, self.remote = trace, known, 0, remote
        self.budget = budget  # tokens it generates here: the output's length; one on a prefill instance

    @property
    def outstanding(self) -> int:
        """The engine's outstanding_tokens: prompt left to compute plus tokens left to generate."""
        return self.known - self.computed + max(0, self.budget - len(self.trace.token_times))


class _Instance:
    def __init__(self, sim: "Simulation", name: str, role: str) -> None:
        self.sim, self.name, self.role = sim, name, role
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.loading: list[_Seq] = []  # admitted, their KV being pulled (they hold seats)
        # The sum of every held sequence's `outstanding` (waiting, loading, running), kept as
        # they change: least-load routing reads it for every instance at every arrival.
        self.outstanding = 0
        self.link_free_at = 0.0  # pulls into this instance share its link, first come first served
        self.busy = False
        self.neighbours: list[_Instance] = []  # the other instances on this one's host
        self.spare_core = False  # its host has room for more instances than the fleet put there
        self.num_steps = 0
        self.busy_s = 0.0

    def recount(self) -> int:
        """`outstanding` summed afresh (what the kept count must always equal)."""
        return sum(s.outstanding for s in itertools.chain(self.waiting, self.loading, self.running))

    def add(self, seq: _Seq, now: float) -> None:
        self.waiting.append(seq)
        self.outstanding += seq.outstanding
        if not self.busy:
            self.start_step(now)

    def start_step(self, now: float) -> None:
        """schedule(): running first within the token budget, then waiting (FCFS) while budget and seats last."""
        sim = self.sim
        budget, max_seqs = sim.max_num_batched_tokens, sim.max_num_seqs
        batch: list[tuple[_Seq, int]] = []
        # The step's shape, summed as the batch is built (split_attn's sums, in the same order):
        # this loop runs for every sequence of every step, the simulator's hot path.
        tokens = kv = sampled = 0
        attn = decode_attn = 0.0
        for seq in self.running:
            if budget <= 0:
                break
            computed, known = seq.computed, seq.known
            n = known - computed
            if n > budget:
                n = budget
            if n > 0:
                batch.append((seq, n))
                budget -= n
                tokens += n
                kv += computed + n
                if computed + n >= known:
                    sampled += 1
                if n == 1:
                    decode_attn += computed + 1.0  # attn_units(1, computed)
                else:
                    attn += n * (computed + (n + 1) / 2.0)
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < max_seqs:
            seq = self.waiting[0]
            if seq.remote:  # a seat, no budget: the pull runs beside the steps
                self.waiting.popleft()
                self.loading.append(seq)
                sim.start_pull(self, seq, now)
                continue
            computed, known = seq.computed, seq.known
            n = known - computed
            if n > budget:
                if not sim.enable_chunked_prefill:
                    break
                n = budget
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
            tokens += n
            kv += computed + n
            if computed + n >= known:
                sampled += 1
            if n == 1:
                decode_attn += computed + 1.0
            else:
                attn += n * (computed + (n + 1) / 2.0)
        if not batch:
            self.busy = False
            return
        chunked = attn > 0
        # The engine's step, then the serving path's per-token work on the same cores; the
        # router's and client's share of it (offcore_token_s) runs on a core of the host that no
        # instance is stepping on, when there is one (1P+1D's prefill between prompts), and takes
        # this step's cycles only when every core of the host is stepping.
        prof = sim.profile
        per_token = prof.token_overhead_s
        if prof.offcore_token_s and (self.spare_core or any(not o.busy for o in self.neighbours)):
            per_token -= prof.offcore_token_s
        seconds = prof.step.seconds(tokens, attn, kv, len(batch), decode_attn) + sampled * per_token
        if sampled:
            seconds += prof.step_overhead_s
        if any(o.busy for o in self.neighbours):
            seconds *= prof.neighbour_prefill if chunked else prof.neighbour_decode
        self.busy = True
        self.num_steps += 1
        self.busy_s += seconds
        sim.at(now + seconds, self.end_step, batch)

    def end_step(self, now: float, batch: list[tuple[_Seq, int]]) -> None:
        """update_from_output(): a request whose computed tokens reach its known tokens samples one."""
        done = False
        prefill = self.role == "prefill"
        at = now + self.sim.profile.request_overhead_s
        outstanding = self.outstanding
        for seq, n in batch:
            seq.computed += n
            outstanding -= n
            if seq.computed < seq.known:
                continue  # a prefill chunk
            seq.known += 1  # and one token more: outstanding unchanged
            trace = seq.trace
            times = trace.token_times
            times.append(at)
            if prefill:
                outstanding -= seq.outstanding
                seq.known = -1  # finished here (prefill_only); its KV waits for the decode's pull
                done = True
                self.outstanding = outstanding
                self.sim.prefill_done(trace, now)
            elif len(times) == trace.request.osl:  # finished
                outstanding -= seq.outstanding
                seq.known = -1
                done = True
        self.outstanding = outstanding
        if done:
            self.running = [s for s in self.running if s.known >= 0]
        self.start_step(now)

    def kv_loaded(self, now: float, seq: _Seq) -> None:
        self.loading.remove(seq)
        self.outstanding -= seq.known - 1 - seq.computed
        seq.computed = seq.known - 1  # the prompt is here; the prefill's token is computed next
        self.running.append(seq)
        if not self.busy:
            self.start_step(now)


class Simulation:
    def __init__(self, profile: Profile, fleet: Fleet) -> None:
        self.profile, self.fleet = profile, fleet
        self.max_num_batched_tokens = fleet.max_num_batched_tokens or profile.max_num_batched_tokens
        self.max_num_seqs = fleet.max_num_seqs or profile.max_num_seqs
        self.enable_chunked_prefill = fleet.enable_chunked_prefill
        self.transfer = profile.transfer(fleet.transport) if fleet.disaggregated else None
        self._events: list = []
        self._order = itertools.count()
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}
        if fleet.disaggregated:
            self.prefills = [_Instance(self, f"prefill{i}", "prefill") for i in range(fleet.num_prefill)]
            self.decodes = [_Instance(self, f"decode{i}", "decode") for i in range(fleet.num_decode)]
        else:
            self.prefills = []
            self.decodes = [_Instance(self, f"colocated{i}", "colocated") for i in range(fleet.num_colocated)]
        per_host = profile.instances_per_host
        instances = self.instances
        for i, inst in enumerate(instances):
            host = i // per_host
            inst.neighbours = [o for o in instances[host * per_host:(host + 1) * per_host] if o is not inst]
            inst.spare_core = len(inst.neighbours) + 1 < per_host

    @property
    def instances(self) -> list[_Instance]:
        return self.prefills + self.decodes

    def at(self, when: float, fn, *args) -> None:
        heapq.heappush(self._events, (when, next(self._order), fn, args))

    def _least_load(self, pool: list[_Instance], role: str) -> _Instance:
        lowest = min(i.outstanding for i in pool)
        best = [i for i in pool if i.outstanding == lowest]
        return best[0] if len(best) == 1 else best[next(self._turn[role]) % len(best)]

    def _arrive(self, now: float, trace: RequestTrace) -> None:
        req = trace.request
        if self.prefills:
            inst = self._least_load(self.prefills, "prefill")
            trace.prefill_instance = inst.name
        else:
            inst = self._least_load(self.decodes, "decode")
            trace.decode_instance = inst.name
        inst.add(_Seq(trace, req.isl, remote=False, budget=1 if inst.role == "prefill" else req.osl), now)

    def prefill_done(self, trace: RequestTrace, now: float) -> None:
        if trace.finished:  # osl == 1: the prefill's token was the whole answer
            return
        self.at(now + self.profile.pd_hop_s, self._to_decode, trace)

    def _to_decode(self, now: float, trace: RequestTrace) -> None:
        inst = self._least_load(self.decodes, "decode")
        trace.decode_instance = inst.name
        inst.add(_Seq(trace, trace.request.isl + 1, remote=True, budget=trace.request.osl), now)

    def start_pull(self, inst: _Instance, seq: _Seq, now: float) -> None:
        nbytes = self.profile.kv_bytes(seq.trace.request.isl)
        start = max(now, inst.link_free_at)
        inst.link_free_at = start + nbytes / self.transfer.bytes_per_s
        self.at(inst.link_free_at + self.transfer.latency_s, inst.kv_loaded, seq)

    def run(self, requests: list[SimRequest]) -> list[RequestTrace]:
        if not self.enable_chunked_prefill:
            too_long = [r for r in requests if r.isl > self.max_num_batched_tokens]
            if too_long:  # the engine would hold it at the head of its queue forever
                raise ValueError(f"a {too_long[0].isl}-token prompt never fits a step of "
                                 f"{self.max_num_batched_tokens} tokens without chunked prefill")
        traces = [RequestTrace(r) for r in requests]
        for trace in traces:
            self.at(trace.request.arrival, self._arrive, trace)
        while self._events:
            when, _, fn, args = heapq.heappop(self._events)
            fn(when, *args)
        unfinished = [t for t in traces if not t.finished]
        assert not unfinished, f"{len(unfinished)} requests never finished (first: {unfinished[0].request})"
        for inst in self.instances:
            assert not (inst.waiting or inst.running or inst.loading or inst.busy), f"{inst.name} still holds work"
        return traces


def simulate(profile: Profile, fleet: Fleet, requests: list[SimRequest]) -> list[RequestTrace]:
    """Every request's token times, in the order given."""
    return Simulation(profile, fleet).run(requests)
