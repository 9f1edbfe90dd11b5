"""Mid-stream migration and no silent truncation: a decode lost after its first token hands the request
to another decode and the client's answer is the undisturbed one; an abort, or a loss past
--migration-limit, is an error, never a 200 with part of the text."""
from __future__ import annotations

import argparse
import concurrent.futures
import signal

import grpc
import pytest

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.router.cli import add_router_parser, config_from_args

from router_fakes import FakeEngine, FakeServer, client_ids, fake_process, toy_generate
from router_harness import wait_until

MIGRATIONS = "pdserve:router_migrations_total"
BODY = {"model": "tiny", "prompt": "Hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


class DyingDecode(FakeEngine):
    """A decode that loses its stream after `die_after` messages, while the shared `deaths` budget
    lasts: with `how` a status (UNAVAILABLE: the instance went away), "eof" (the stream just ends),
    "abort_reason" (an engine that reports finish_reason "abort") or, whatever `die_after`,
    "unfinished" (the last token comes without its finish reason, then the stream ends)."""

    def __init__(self, *args, deaths: list[int], die_after: int, how=grpc.StatusCode.UNAVAILABLE, **kwargs) -> None:
        super().__init__("decode", *args, **kwargs)
        self.deaths, self.die_after, self.how = deaths, die_after, how
        self.lost: list = []  # the requests whose streams it lost

    async def Decode(self, request, context):
        dying = self.deaths[0] > 0
        self.deaths[0] -= dying
        sent = 0
        async for msg in super().Decode(request, context):
            if dying and self.how == "unfinished":
                if msg.finish_reason:
                    self.lost.append(request)
                    msg.finish_reason = ""
                    yield msg
                    return
            elif dying and sent == self.die_after:
                self.lost.append(request)
                if self.how == "eof":
                    return
                if self.how == "abort_reason":
                    msg.finish_reason = "abort"
                    yield msg
                    return
                await context.abort(self.how, f"{self.name} went away")
            yield msg
            sent += 1


@pytest.fixture
def migration_stack(make_stack, loop_thread):
    """migration_stack(prefill=0|1, deaths=N, die_after=K, how=..., **router config): a router over
    two decodes that lose streams while `deaths` lasts."""
    servers = []

    def make(prefill: int = 1, deaths: int = 1, die_after: int = 3, how=grpc.StatusCode.UNAVAILABLE, **config):
        budget = [deaths]

        async def start():
            return [await FakeServer(DyingDecode(name=f"dying-{i}", deaths=budget, die_after=die_after,
                                                 how=how)).start() for i in range(2)]

        decodes = loop_thread.run(start())
        servers.extend(decodes)
        stack = make_stack(prefill=prefill, decode=0, extra_decode=tuple(d.address for d in decodes), **config)
        stack.decodes = decodes
        stack.budget = budget
        return stack

    yield make
    for s in servers:
        loop_thread.run(s.stop(0))


def undated(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def sse_parts(events: list) -> tuple[str, list, list]:
    """(the text, the finish reasons, the error events) of a streamed completion."""
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    return ("".join(c["choices"][0]["text"] for c in chunks),
            [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]],
            [e["error"] for e in events if isinstance(e, dict) and "error" in e])


def decode_requests(stack) -> list:
    return [r for d in stack.decodes for r in d.engine.requests]


@pytest.mark.parametrize("prefill", [0, 1], ids=["colocated", "disaggregated"])
def test_a_lost_decode_hands_the_stream_to_another(migration_stack, tokenizer, prefill):
    stack = migration_stack(prefill=prefill, deaths=0)
    body = {**BODY, "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}}
    undisturbed = stack.sse("/v1/completions", body)
    stack.budget[0] = 1
    events = stack.sse("/v1/completions", body)

    text, finishes, errors = sse_parts(events)
    ids, _ = toy_generate(tokenizer.encode("Hello world"), 12)
    assert text == tokenizer.decode(ids) and finishes == ["length"] and not errors
    assert events[-1] == "[DONE]" and events[-2]["usage"] == undisturbed[-2]["usage"]
    assert [undated(e) for e in events[:-1]] == [undated(e) for e in undisturbed[:-1]]  # logprobs, offsets too
    assert stack.metric(MIGRATIONS, {"outcome": "completed"}) == 1

    # The survivor continued from the prompt plus what was sent, with a budget that much smaller.
    [lost] = [r for d in stack.decodes for r in d.engine.lost]
    moved = max(decode_requests(stack), key=lambda r: len(r.prompt_token_ids))
    sent = 3 + lost.HasField("first_token_id")  # the dying decode's messages, after a prefill's first token
    assert list(moved.prompt_token_ids) == tokenizer.encode("Hello world") + ids[:sent]
    assert moved.sampling.max_tokens == 12 - sent and moved.sampling.logprobs == 2
    assert moved.request_id != lost.request_id and client_ids([moved.request_id]) == client_ids([lost.request_id])
    dying = next(d for d in stack.decodes if d.engine.lost)
    wait_until(lambda: lost.request_id in dying.engine.aborts, what="the lost upstream request aborted")
    # The open streams conditional disaggregation counts on each decode: none left, lost or finished.
    assert [i.streams for i in stack.router.pool.instances("decode")] == [0, 0]


def test_non_streaming_answer_and_stop_strings_survive_a_migration(migration_stack, tokenizer):
    stack = migration_stack(prefill=1, deaths=0, die_after=2)
    ids, _ = toy_generate(tokenizer.encode("Hello world"), 12)
    stop = tokenizer.decode(ids[6:8])  # met after the migration point
    body = {**BODY, "stop": [stop], "min_tokens": 5}
    status, _, undisturbed = stack.post("/v1/completions", body)
    assert status == 200 and undisturbed["choices"][0]["finish_reason"] == "stop"
    stack.budget[0] = 1
    status, _, migrated = stack.post("/v1/completions", body)
    assert status == 200, migrated
    assert undated(migrated) == undated(undisturbed)
    [lost] = [r for d in stack.decodes for r in d.engine.lost]
    moved = max(decode_requests(stack), key=lambda r: len(r.prompt_token_ids))
    sent = 2 + lost.HasField("first_token_id")
    assert moved.sampling.min_tokens == 5 - sent and len(moved.prompt_token_ids) == len(lost.prompt_token_ids) + sent


def test_a_stream_that_ends_without_a_finish_reason_is_migrated(migration_stack, tokenizer):
    stack = migration_stack(prefill=0, how="eof")
    status, _, body = stack.post("/v1/completions", BODY)
    assert status == 200 and body["choices"][0]["text"] == tokenizer.decode(
        toy_generate(tokenizer.encode("Hello world"), 12)[0])
    assert stack.metric(MIGRATIONS, {"outcome": "completed"}) == 1


def test_a_stream_lost_after_its_last_token_ends_at_max_tokens(migration_stack, tokenizer):
    stack = migration_stack(prefill=0, how="unfinished", migration_limit=0)  # none needed
    status, _, body = stack.post("/v1/completions", BODY)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["choices"][0]["text"] == tokenizer.decode(toy_generate(tokenizer.encode("Hello world"), 12)[0])
    assert len(decode_requests(stack)) == 1  # nothing was left to generate: no migration


@pytest.mark.parametrize("limit", [0, 1])
def test_past_the_migration_limit_the_client_gets_an_error(migration_stack, limit):
    stack = migration_stack(prefill=1, deaths=2 * (limit + 1), migration_limit=limit)
    status, _, body = stack.post("/v1/completions", BODY)
    assert status == 502 and body["error"]["code"] == "migration_limit_reached", body
    assert "failed mid-stream: UNAVAILABLE" in body["error"]["message"]
    decodes = stack.router.pool.instances("decode")
    wait_until(lambda: all(i.healthy for i in decodes), what="the health checks to bring the decodes back")

    events = stack.sse("/v1/completions", {**BODY, "stream": True})
    text, finishes, errors = sse_parts(events)
    assert text and not finishes  # the tokens that came, then the error: no finish_reason chunk
    assert [e["code"] for e in errors] == ["migration_limit_reached"] and events[-1] == "[DONE]"
    assert stack.metric(MIGRATIONS, {"outcome": "limit_reached"}) == 2
    assert stack.metric(MIGRATIONS, {"outcome": "lost_again"}) == 2 * limit


def test_no_decode_left_to_migrate_to_is_an_error(make_stack, loop_thread):
    async def start():
        return await FakeServer(DyingDecode(deaths=[1], die_after=2)).start()

    dying = loop_thread.run(start())
    try:
        stack = make_stack(prefill=1, decode=0, extra_decode=(dying.address,))
        events = stack.sse("/v1/completions", {**BODY, "stream": True})
        _, finishes, errors = sse_parts(events)
        assert not finishes and errors[0]["code"] == "no_healthy_instance", errors
        assert stack.metric(MIGRATIONS, {"outcome": "failed"}) == 1
    finally:
        loop_thread.run(dying.stop(0))


@pytest.mark.parametrize("how", [grpc.StatusCode.ABORTED, "abort_reason"], ids=["ABORTED", "finish_reason"])
def test_an_aborted_decode_is_an_error_not_a_short_answer(migration_stack, how):
    stack = migration_stack(prefill=1, deaths=2, how=how)
    status, _, body = stack.post("/v1/completions", BODY)
    assert status == 502 and body["error"]["type"] == "upstream_error", body
    assert "abort" in body["error"]["message"].lower()
    _, finishes, errors = sse_parts(stack.sse("/v1/completions", {**BODY, "stream": True}))
    assert not finishes and len(errors) == 1
    assert len(decode_requests(stack)) == 2  # never migrated: an abort is the request's fate
    assert stack.metric(MIGRATIONS, {"outcome": "completed"}) == 0


def test_a_sigkilled_decode_process_mid_stream(make_stack, tokenizer):
    """A real process dies (SIGKILL, no goodbye) while it streams: the client's stream carries on."""
    with fake_process("decode", "--token-delay", "0.05") as (proc, victim):
        stack = make_stack(prefill=1, decode=1, extra_decode=(victim,))
        survivor = stack.router.pool.instances("decode")[1]
        stack.lt.run(stack.decodes[0].set_serving(False))  # the request goes to the victim
        wait_until(lambda: not survivor.healthy, what="the survivor out of rotation")
        body = {**BODY, "max_tokens": 60, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(stack.sse, "/v1/completions", body)
            routed = {"role": "decode", "instance": victim}
            wait_until(lambda: stack.metric("pdserve:router_generation_tokens_total") >= 5 and
                       stack.metric("pdserve:router_routing_decisions_total", routed) == 1, what="tokens streamed")
            stack.lt.run(stack.decodes[0].set_serving(True))
            wait_until(lambda: survivor.healthy, what="the survivor back")
            proc.send_signal(signal.SIGKILL)
        text, finishes, errors = sse_parts(future.result(30))
        assert not errors and finishes == ["length"]
        assert text == tokenizer.decode(toy_generate(tokenizer.encode("Hello world"), 60)[0])
        assert stack.metric(MIGRATIONS, {"outcome": "completed"}) == 1


def test_grpc_generate_migrates_too_and_fails_loudly_past_the_limit(migration_stack, tokenizer):
    stack = migration_stack(prefill=1, deaths=1, migration_limit=1)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        request = pb.GenerateRequest(text="Hello world", sampling=pb.SamplingParams(max_tokens=12, ignore_eos=True))
        chunks = list(stub.Generate(request, timeout=30))
        assert [t for c in chunks for t in c.token_ids] == toy_generate(tokenizer.encode("Hello world"), 12)[0]
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
        stack.budget[0] = 2
        decodes = stack.router.pool.instances("decode")
        wait_until(lambda: all(i.healthy for i in decodes), what="the health checks to bring the decodes back")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "migration limit" in err.value.details()


def test_the_migration_limit_flag():
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))

    def parse(*argv):
        return config_from_args(parser.parse_args(["router", "--decode", "h:1", *argv]))

    assert parse().migration_limit == 3 and parse("--migration-limit", "0").migration_limit == 0
    with pytest.raises(ValueError, match="--migration-limit"):
        parse("--migration-limit", "-1")
