"""Background responses (`background: true`), driven by the official `openai` client: answered
queued at once, polled to their end, cancelled mid-way (upstream too), streamed and resumed after a
sequence number, and drained when the router stops."""
from __future__ import annotations

import time

import grpc
import openai
import pytest

from router_fakes import client_ids, toy_generate
from router_harness import wait_until
from test_router_responses import chat_ids, client_of

SLOW = [{"token_delay": 0.02}]  # 20 ms a token: a long answer is still running when the test looks


@pytest.fixture
def stack(make_stack):
    return make_stack(prefill=1, decode=1, responses_store_size=8, decode_kwargs=SLOW)


@pytest.fixture
def client(stack):
    with client_of(stack) as c:
        yield c


def poll(client, response_id: str, until=lambda r: r.status not in ("queued", "in_progress"), timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.responses.retrieve(response_id)
        if until(response):
            return response
        assert time.monotonic() < deadline, response.status
        time.sleep(0.02)


def test_a_background_response_is_polled_to_the_answer_it_would_have_given(stack, client, tokenizer):
    created = client.responses.create(model="tiny", input="Name a colour.", max_output_tokens=12, background=True)
    assert created.status == "queued" and created.background and created.output == [] and created.usage is None
    # It holds a place among the router's requests in flight while it runs, and none after.
    assert stack.router.admission.in_flight == 1
    done = poll(client, created.id)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    ids, _ = toy_generate(chat_ids(tokenizer, [{"role": "user", "content": "Name a colour."}]), 12)
    assert done.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert done.usage.output_tokens == 12 and done.background
    wait_until(lambda: stack.router.admission.in_flight == 0)
    # Done, it continues a conversation as any stored response does; cancelling it changes nothing.
    assert client.responses.cancel(done.id).status == "incomplete"
    more = client.responses.create(model="tiny", previous_response_id=done.id, input="Another.", max_output_tokens=2)
    assert more.status == "incomplete"


def test_cancel_stops_it_where_it_is_and_aborts_upstream(stack, client):
    created = client.responses.create(model="tiny", input="Tell a long story.", max_output_tokens=400,
                                      background=True)
    running = poll(client, created.id, until=lambda r: r.status == "in_progress" and r.output_text)
    assert running.output[0].status == "in_progress"
    # A conversation goes on from a finished response only.
    with pytest.raises(openai.BadRequestError, match="still in_progress"):
        client.responses.create(model="tiny", previous_response_id=created.id, input="And?", max_output_tokens=2)
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.output_text.startswith(running.output_text)
    assert cancelled.usage is None and cancelled.output[0].status == "incomplete"
    wait_until(lambda: created.id in client_ids(stack.decodes[0].engine.cancelled))  # the decode stopped generating
    assert not stack.decodes[0].engine.running
    later = client.responses.retrieve(created.id)
    assert later.status == "cancelled" and later.output_text == cancelled.output_text
    assert client.responses.cancel(created.id).status == "cancelled"
    wait_until(lambda: stack.router.admission.in_flight == 0)


def test_a_background_stream_resumes_after_the_last_event_seen(stack, client):
    stream = client.responses.create(model="tiny", input="Count.", max_output_tokens=30, background=True,
                                     stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) >= 6:
            break
    # Followed or not, it holds one place among the requests in flight: the task's.
    assert stack.router.admission.in_flight == 1
    stream.close()  # the connection drops; the response goes on
    assert [e.type for e in seen[:2]] == ["response.created", "response.queued"]
    assert seen[0].response.status == "queued" and seen[0].response.background
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    response_id = seen[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    assert [e.sequence_number for e in rest] == list(range(len(seen), len(seen) + len(rest)))
    assert rest[-1].type == "response.incomplete"
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == client.responses.retrieve(response_id).output_text
    # From the start, all of it again, the same.
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in seen + rest]


def test_a_background_response_that_fails_says_why(make_stack):
    stack = make_stack(prefill=1, decode=1, responses_store_size=8,
                       prefill_kwargs=[{"fail": grpc.StatusCode.INVALID_ARGUMENT, "fail_times": -1}])
    with client_of(stack) as client:
        created = client.responses.create(model="tiny", input="hi", max_output_tokens=4, background=True)
        failed = poll(client, created.id)
    assert failed.status == "failed" and failed.error.message


def test_what_background_needs_and_bad_retrievals(make_stack, stack, client):
    status, _, err = stack.post("/v1/responses", {"input": "hi", "background": True, "store": False})
    assert status == 400 and err["error"]["param"] == "background" and "store" in err["error"]["message"]
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background=true"):
        client.responses.cancel(plain.id)
    for query, param in (("stream=true", "stream"), ("stream=maybe", "stream"),
                         ("stream=true&starting_after=x", "starting_after"),
                         ("stream=true&starting_after=--1", "starting_after")):
        status, _, err = stack.request("GET", f"/v1/responses/{plain.id}?{query}")
        assert status == 400 and err["error"]["param"] == param, query
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    # Without a store, there is nowhere to keep it.
    bare = make_stack(prefill=1, decode=1)
    status, _, err = bare.post("/v1/responses", {"input": "hi", "background": True})
    assert status == 400 and "--responses-store-size" in err["error"]["message"]


def test_an_id_still_running_in_the_background_is_not_reused(stack, client):
    """A client's X-Request-Id names the response: while a background response of that id runs,
    another request with it is a 409 (it would replace the running one in the store)."""
    headers = {"X-Request-Id": "bg-job-1"}
    created = client.responses.create(model="tiny", input="Go on.", max_output_tokens=400, background=True,
                                      extra_headers=headers)
    assert created.id == "bg-job-1"
    for background in (True, False):
        status, _, err = stack.post("/v1/responses", {"input": "hi", "max_output_tokens": 2, "background": background},
                                    headers=headers)
        assert status == 409 and err["error"]["code"] == "response_id_in_use"
    client.responses.cancel("bg-job-1")
    wait_until(lambda: stack.router.admission.in_flight == 0)
    again = client.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_headers=headers)
    assert again.id == "bg-job-1" and again.status == "incomplete"  # done: the id is free again


def test_a_running_background_response_counts_against_the_in_flight_cap(make_stack):
    """--max-concurrent-requests holds on the background path: while one runs (its request long
    answered), the next request is a 429, and once it is done the router takes requests again."""
    stack = make_stack(prefill=1, decode=1, responses_store_size=8, decode_kwargs=SLOW, max_concurrent_requests=1)
    with client_of(stack) as client:
        created = client.responses.create(model="tiny", input="Go on.", max_output_tokens=400, background=True)
        for body in ({"input": "hi", "max_output_tokens": 2}, {"input": "hi", "max_output_tokens": 2,
                                                                "background": True}):
            status, headers, err = stack.post("/v1/responses", body)
            assert status == 429 and err["error"]["code"] == "router_at_capacity" and headers["Retry-After"]
        client.responses.cancel(created.id)
        wait_until(lambda: stack.router.admission.in_flight == 0)
        assert client.responses.create(model="tiny", input="hi", max_output_tokens=2).status == "incomplete"


def test_deleting_a_running_one_cancels_it(stack, client):
    created = client.responses.create(model="tiny", input="Go on.", max_output_tokens=400, background=True)
    poll(client, created.id, until=lambda r: r.status == "in_progress")
    client.responses.delete(created.id)
    wait_until(lambda: created.id in client_ids(stack.decodes[0].engine.cancelled))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    wait_until(lambda: stack.router.admission.in_flight == 0)


def test_the_router_lets_background_responses_finish_as_it_stops(make_stack, loop_thread):
    stack = make_stack(prefill=1, decode=1, responses_store_size=8, decode_kwargs=SLOW, drain_timeout_s=0.3)
    with client_of(stack) as client:
        short = client.responses.create(model="tiny", input="hi", max_output_tokens=3, background=True)
        long = client.responses.create(model="tiny", input="Go on.", max_output_tokens=400, background=True)
        poll(client, long.id, until=lambda r: r.status == "in_progress")
    serving = stack.router.responses_serving
    loop_thread.run(stack.router.stop())
    # Within the drain timeout the short one finished; the long one was cancelled upstream.
    assert serving.stored(short.id)["status"] == "incomplete"
    assert serving.stored(long.id)["status"] == "cancelled"
    wait_until(lambda: long.id in client_ids(stack.decodes[0].engine.cancelled))
