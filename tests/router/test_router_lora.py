"""LoRA adapters at the router (vLLM's --lora-modules): a request's model name picks the adapter on
every front, the engines are asked for it, /v1/models lists it under the base model, and the
adapter's prefix-cache key goes into KV-aware routing."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from engine.block_hash import hash_request_tokens, lora_key
from engine.kv_events import BlockStored, KVEventBatch
from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.router.kv_index import KvIndex
from services.router.policy import KvAware, RouteRequest

from router_harness import router_config, wait_until

MODULES = (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def stack(make_stack):
    return make_stack(lora_modules=MODULES)


def asked(stack) -> str:
    """The adapter the last engine request ran with ("" for the base model)."""
    return stack.decodes[0].engine.requests[-1].sampling.lora_name


def test_the_model_name_picks_the_adapter_on_every_front(stack):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                       ("/v1/messages", {"messages": HI, "max_tokens": 2})):
        for model, lora in (("sql", "sql"), ("chat", "chat"), ("tiny", "")):
            status, _, out = stack.post(path, {**body, "model": model})
            assert status == 200, (path, model, out)
            assert asked(stack) == lora and out["model"] == model, (path, model)
        status, _, err = stack.post(path, {**body, "model": "nope"})
        assert status == 404, path
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        list(stub.Generate(pb.GenerateRequest(model="sql", text="hi", sampling=pb.SamplingParams(max_tokens=2))))
        assert asked(stack) == "sql"
        list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))))
        assert asked(stack) == ""


def test_models_lists_the_adapters_under_the_base_model(stack):
    status, _, body = stack.request("GET", "/v1/models")
    cards = {c["id"]: c for c in body["data"]}
    assert list(cards) == ["tiny", "sql", "chat"]
    assert cards["tiny"]["parent"] is None
    assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == "/adapters/sql"
    status, _, card = stack.request("GET", "/v1/models/chat")
    assert status == 200 and card["root"] == "/adapters/chat"


def test_kv_aware_routing_hashes_the_prompt_with_the_adapters_key():
    """The engines key an adapter's blocks with ("lora", name, path): the router's hashes must
    match them, or a prompt cached under the adapter would look uncached (and the base model's
    blocks would look like its)."""
    prompt, bs = list(range(64)), 16
    key = lora_key("sql", dict(MODULES))
    index = KvIndex()
    stream = index.add_stream("e1", "tcp://x:1", "", epoch=1, block_size=bs)
    stored = BlockStored(hash_request_tokens(prompt, bs, lora=key), None, prompt, bs, None, "GPU", "sql")
    assert index.apply(stream, 0, KVEventBatch(ts=0.0, events=[stored], epoch=1))
    policy = KvAware(index, overlap_weight=1.0)
    e1 = SimpleNamespace(address="e1", load_score=0)
    assert policy.costs([e1], RouteRequest("a", "prefill", prompt, lora=key)) == [0]
    assert policy.costs([e1], RouteRequest("b", "prefill", prompt)) == [64]


def test_the_flag_in_its_forms_and_names_that_clash(tiny_model_path, monkeypatch):
    config = router_config(tiny_model_path, "--lora-modules", "sql=/a", '{"name": "chat", "path": "/b"}')
    assert config.lora_modules == (("sql", "/a"), ("chat", "/b"))
    monkeypatch.setenv("PDSERVE_ROUTER_LORA_MODULES", "x=/x y=/y")
    assert router_config(tiny_model_path).lora_modules == (("x", "/x"), ("y", "/y"))
    monkeypatch.delenv("PDSERVE_ROUTER_LORA_MODULES")
    with pytest.raises(ValueError, match="a name of its own"):
        router_config(tiny_model_path, "--served-model-name", "m", "--lora-modules", "m=/a")
    with pytest.raises(ValueError, match="a name of its own"):
        router_config(tiny_model_path, "--lora-modules", "a=/1", "a=/2")


def test_runtime_loading_is_off_unless_allowed(stack):
    status, _, err = stack.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"})
    assert status == 404 and "--allow-runtime-lora-updating" in err["error"]["message"]
    status, _, err = stack.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in err["error"]["message"]
    assert not any(f.engine.lora_adapters for f in stack.prefills + stack.decodes)


@pytest.fixture
def runtime(make_stack):
    return make_stack(decode=2, lora_modules=MODULES, allow_runtime_lora_updating=True)


def engines(stack) -> list:
    return [f.engine for f in stack.prefills + stack.decodes]


def test_an_adapter_loads_on_every_engine_and_becomes_a_model(runtime):
    status, _, text = runtime.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"})
    assert status == 200 and text == b"Success: LoRA adapter 'new' added successfully."
    assert all(e.lora_adapters == {"new": "/adapters/new"} for e in engines(runtime))  # prefill and decodes
    status, _, body = runtime.request("GET", "/v1/models")
    cards = {c["id"]: c for c in body["data"]}
    assert list(cards) == ["tiny", "sql", "chat", "new"] and cards["new"]["root"] == "/adapters/new"
    assert cards["new"]["parent"] == "tiny"
    for _ in range(2):  # each decode in turn
        status, _, out = runtime.post("/v1/completions", {"model": "new", "prompt": "hi", "max_tokens": 2})
        assert status == 200 and out["model"] == "new"
    assert [d.engine.requests[-1].sampling.lora_name for d in runtime.decodes] == ["new", "new"]
    assert runtime.prefills[0].engine.requests[-1].sampling.lora_name == "new"

    status, _, err = runtime.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/other"})
    assert status == 400 and err["error"]["message"] == "The lora adapter 'new' has already been loaded."
    status, _, err = runtime.post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/other"})
    assert status == 400  # --lora-modules' names are taken too
    status, _, err = runtime.post("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/adapters/x"})
    assert status == 400 and "a name of the base model" in err["error"]["message"]
    for body in ({"lora_name": "x"}, {"lora_path": "/adapters/x"}, {"lora_name": 3, "lora_path": "/a"}):
        status, _, err = runtime.post("/v1/load_lora_adapter", body)
        assert status == 400 and "must be provided" in err["error"]["message"], body
    status, _, err = runtime.post("/v1/load_lora_adapter", b"[1]")
    assert status == 400

    status, _, text = runtime.post("/v1/unload_lora_adapter", {"lora_name": "new"})
    assert status == 200 and text == b"Success: LoRA adapter 'new' removed successfully."
    wait_until(lambda: not any(e.lora_adapters for e in engines(runtime)), what="the engines to unload it")
    status, _, _ = runtime.post("/v1/completions", {"model": "new", "prompt": "hi", "max_tokens": 2})
    assert status == 404
    status, _, err = runtime.post("/v1/unload_lora_adapter", {"lora_name": "new"})
    assert status == 404 and err["error"]["message"] == "The lora adapter 'new' cannot be found."
    # A --lora-modules adapter unloads too (vLLM's rule): gone from the model names.
    status, _, _ = runtime.post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200
    status, _, body = runtime.request("GET", "/v1/models")
    assert [c["id"] for c in body["data"]] == ["tiny", "sql"]


def test_a_load_one_engine_refuses_is_undone_everywhere(runtime):
    runtime.decodes[1].engine.lora_enabled = False  # started without --enable-lora
    status, _, err = runtime.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"})
    assert status == 400
    assert runtime.decodes[1].address in err["error"]["message"] and "FAILED_PRECONDITION" in err["error"]["message"]
    assert not any(e.lora_adapters for e in engines(runtime))  # those that had loaded it unloaded it
    runtime.decodes[1].engine.lora_enabled = True
    status, _, err = runtime.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/bad/new"})
    assert status == 400 and err["error"]["param"] == "lora_path"
    assert "no adapter_config.json" in err["error"]["message"]
    assert not any(e.lora_adapters for e in engines(runtime))
    status, _, _ = runtime.post("/v1/completions", {"model": "new", "prompt": "hi", "max_tokens": 2})
    assert status == 404


def test_engines_that_join_or_restart_get_the_runtime_adapters_before_requests(runtime, loop_thread):
    from router_fakes import start_fake

    runtime.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"})
    pool = runtime.router.pool
    joined = loop_thread.run(start_fake("decode", name="decode-joined"))
    try:
        addresses = tuple(i.address for i in pool.instances("decode")) + (joined.address,)
        loop_thread.run(_call(lambda: pool.update("decode", addresses)))
        inst = next(i for i in pool.instances("decode") if i.address == joined.address)
        wait_until(lambda: inst.healthy, what="the joined decode to turn healthy")
        assert joined.engine.lora_adapters == {"new": "/adapters/new"}  # loaded before it took requests
        # A restart: the engine comes back without what was loaded at run time.
        restarted = runtime.decodes[0]
        loop_thread.run(restarted.set_serving(False))
        first = next(i for i in pool.instances("decode") if i.address == restarted.address)
        wait_until(lambda: not first.healthy, what="the restarting decode to be seen down")
        restarted.engine.lora_adapters.clear()
        loop_thread.run(restarted.set_serving(True))
        wait_until(lambda: first.healthy, what="the restarted decode to be healthy again")
        assert restarted.engine.lora_adapters == {"new": "/adapters/new"}
        assert "sql" not in restarted.engine.lora_adapters  # --lora-modules' are the engine's own flags
    finally:
        loop_thread.run(joined.stop(0))


async def _call(fn):
    return fn()


def test_an_unload_waits_for_the_adapters_running_requests(make_stack):
    """The name goes at once (new requests: 404) but the engines keep the adapter until the request
    running on it has finished, complete; a load of the same name (a new version) comes after."""
    import threading

    stack = make_stack(decode_kwargs=[{"token_delay": 0.02}], allow_runtime_lora_updating=True,
                       load_poll_interval_s=0.05)
    stack.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/v1"})
    done = {}
    reader = threading.Thread(target=lambda: done.update(out=stack.post(
        "/v1/completions", {"model": "new", "prompt": "hi", "max_tokens": 60, "ignore_eos": True})))
    reader.start()
    decode = stack.decodes[0].engine
    wait_until(lambda: decode.running, what="the request to run")
    status, _, _ = stack.post("/v1/unload_lora_adapter", {"lora_name": "new"})
    assert status == 200 and decode.running  # answered without waiting for it
    polls = decode.load_requests
    wait_until(lambda: decode.load_requests >= polls + 3, what="load reports to come in meanwhile")
    assert decode.running and decode.lora_adapters == {"new": "/adapters/v1"}  # still running on it
    status, _, _ = stack.post("/v1/completions", {"model": "new", "prompt": "hi", "max_tokens": 2})
    assert status == 404
    status, _, text = stack.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/v2"})
    reader.join(30)
    status_running, _, out = done["out"]
    assert status_running == 200 and out["usage"]["completion_tokens"] == 60
    assert status == 200 and decode.lora_adapters == {"new": "/adapters/v2"}
    assert stack.prefills[0].engine.lora_adapters == {"new": "/adapters/v2"}


def test_the_resolver_loads_an_adapter_a_request_names_from_its_folder(make_stack):
    """vLLM's filesystem LoRA resolver: a model name the router does not serve is looked up as
    <dir>/<name> on the engines, once however many requests ask; a name that is none is a 404 and
    is not looked up again for a while; a name that is a path is never looked up."""
    import threading

    stack = make_stack(decode=2, allow_runtime_lora_updating=True, lora_resolver_dir="/adapters")
    for fake in stack.prefills + stack.decodes:
        fake.engine.lora_folders = {"/adapters/sql-v2", "/adapters/grpc-one"}
    loads = lambda: sum(c.endswith("/LoadLoRAAdapter") for f in stack.prefills + stack.decodes for c in f.calls)
    results = []
    body = {"model": "sql-v2", "prompt": "hi", "max_tokens": 2}
    threads = [threading.Thread(target=lambda: results.append(stack.post("/v1/completions", body)))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [(status, out["model"]) for status, _, out in results] == [(200, "sql-v2")] * 6
    assert loads() == 3  # once on each engine, for six requests at once
    assert all(e.lora_adapters == {"sql-v2": "/adapters/sql-v2"} for e in engines(stack))
    status, _, body = stack.request("GET", "/v1/models")
    assert [c["id"] for c in body["data"]] == ["tiny", "sql-v2"]

    status, _, err = stack.post("/v1/chat/completions", {"model": "ghost", "messages": HI, "max_tokens": 2})
    assert status == 404 and err["error"]["code"] == "model_not_found" and loads() == 6  # tried, refused
    assert not any("ghost" in e.lora_adapters for e in engines(stack))
    status, _, _ = stack.post("/v1/completions", {"model": "ghost", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and loads() == 6  # not tried again so soon
    for name in ("../sql-v2", "a/b", ".hidden", "x" * 200):
        status, _, _ = stack.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
        assert status == 404, name
    assert loads() == 6
    status, _, _ = stack.request("GET", "/v1/models/grpc-one")
    assert status == 404 and loads() == 6  # only requests that generate load an adapter

    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        list(stub.Generate(pb.GenerateRequest(model="grpc-one", text="hi", sampling=pb.SamplingParams(max_tokens=2))))
        assert asked(stack) == "grpc-one" or stack.decodes[1].engine.requests[-1].sampling.lora_name == "grpc-one"
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(model="nobody", text="hi")))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not exist" in e.value.details()


def test_the_resolver_needs_runtime_updating():
    from services.router.config import RouterConfig

    with pytest.raises(ValueError, match="--lora-resolver-dir loads adapters at run time: it needs "
                                         "--allow-runtime-lora-updating"):
        RouterConfig(model="tiny", served_model_name="tiny", decode=("127.0.0.1:1",), lora_resolver_dir="/adapters")


def test_the_resolver_keeps_the_most_recently_used_adapters(make_stack):
    stack = make_stack(allow_runtime_lora_updating=True, lora_resolver_dir="/adapters", lora_resolver_max_loras=2)
    for fake in stack.prefills + stack.decodes:
        fake.engine.lora_folders = {"/adapters/a", "/adapters/b", "/adapters/c"}

    def ask(name: str) -> None:
        status, _, out = stack.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
        assert status == 200 and out["model"] == name

    def loaded() -> set[str]:
        wait_until(lambda: len({frozenset(e.lora_adapters) for e in engines(stack)}) == 1, what="the engines to agree")
        return set(stack.decodes[0].engine.lora_adapters)

    for name in ("a", "b", "a"):
        ask(name)
    assert loaded() == {"a", "b"}
    ask("c")  # one too many: b's last request is the oldest
    wait_until(lambda: loaded() == {"a", "c"}, what="b to be unloaded")
    status, _, body = stack.request("GET", "/v1/models")
    assert [c["id"] for c in body["data"]] == ["tiny", "a", "c"]
    ask("b")  # back, in a's place now
    wait_until(lambda: loaded() == {"b", "c"}, what="a to be unloaded")
    with pytest.raises(ValueError, match="--lora-resolver-max-loras must be >= 1"):
        router_config("tiny", "--allow-runtime-lora-updating", "--lora-resolver-dir", "/a",
                      "--lora-resolver-max-loras", "0")


def test_engines_that_had_the_adapter_keep_it_and_a_busy_engine_is_asked_again(runtime):
    """An engine with the adapter from that path already (another router replica loaded it, or
    this router before a restart) counts as loaded, and is not made to unload it when another
    engine refuses; an engine still finishing the name's previous adapter is asked again."""
    first, second = runtime.decodes[0].engine, runtime.decodes[1].engine
    first.lora_adapters["pre"] = "/adapters/pre"
    second.lora_enabled = False
    status, _, _ = runtime.post("/v1/load_lora_adapter", {"lora_name": "pre", "lora_path": "/adapters/pre"})
    assert status == 400
    assert first.lora_adapters == {"pre": "/adapters/pre"} and runtime.prefills[0].engine.lora_adapters == {}
    second.lora_enabled = True
    second.lora_busy = 3
    status, _, text = runtime.post("/v1/load_lora_adapter", {"lora_name": "pre", "lora_path": "/adapters/pre"})
    assert status == 200, text
    assert all(e.lora_adapters == {"pre": "/adapters/pre"} for e in engines(runtime)) and second.lora_busy == 0
    # The name loaded from another path on one engine: a refusal that names it, the others undone.
    second.lora_adapters["other"] = "/adapters/elsewhere"
    status, _, err = runtime.post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": "/adapters/x"})
    assert status == 400 and "ALREADY_EXISTS" in err["error"]["message"]
    assert "other" not in first.lora_adapters and second.lora_adapters["other"] == "/adapters/elsewhere"


def test_an_engine_out_of_reach_at_the_unload_unloads_when_it_is_back(runtime, loop_thread):
    runtime.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"})
    away = runtime.decodes[1]
    inst = next(i for i in runtime.router.pool.instances("decode") if i.address == away.address)
    loop_thread.run(away.set_serving(False))
    wait_until(lambda: not inst.healthy, what="the decode to be seen down")
    runtime.post("/v1/unload_lora_adapter", {"lora_name": "new"})
    wait_until(lambda: "new" not in runtime.decodes[0].engine.lora_adapters, what="the reachable ones to unload")
    assert away.engine.lora_adapters == {"new": "/adapters/new"}  # it never heard
    loop_thread.run(away.set_serving(True))
    wait_until(lambda: inst.healthy, what="the decode to be back")
    assert away.engine.lora_adapters == {}  # its report showed it: unloaded before it took requests


def test_a_request_whose_adapter_went_after_it_was_read_is_a_404_not_the_base_model(runtime, loop_thread):
    from services.router.errors import ModelNotFound

    router = runtime.router
    with pytest.raises(ModelNotFound):  # read after the unload: no adapter, so no base model either
        router.model.lora_of("gone")
    assert router.model.lora_of("tiny") is None and router.model.lora_of("sql") == "sql"

    async def dispatch():  # read while it was served, dispatched after it went
        chunks = router.dispatcher.stream("r-gone", [5, 6, 7], pb.SamplingParams(max_tokens=2, lora_name="gone"))
        with pytest.raises(ModelNotFound):
            await chunks.__anext__()

    loop_thread.run(dispatch())
    assert not router.dispatcher.lora_streams


def test_requests_for_an_adapter_go_to_the_engines_that_have_it(runtime, loop_thread):
    """A decode that joined and could not load a runtime adapter (its volume lacks the folder)
    serves the base model, and the adapter's requests go to the decodes that have it."""
    from router_fakes import start_fake

    runtime.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"})
    pool = runtime.router.pool
    joined = loop_thread.run(start_fake("decode", name="decode-joined"))
    joined.engine.lora_folders = set()
    try:
        addresses = tuple(i.address for i in pool.instances("decode")) + (joined.address,)
        loop_thread.run(_call(lambda: pool.update("decode", addresses)))
        inst = next(i for i in pool.instances("decode") if i.address == joined.address)
        wait_until(lambda: inst.healthy, what="the joined decode to turn healthy")
        assert joined.engine.lora_adapters == {} and inst.loras == set()
        for _ in range(6):
            status, _, _ = runtime.post("/v1/completions", {"model": "new", "prompt": "hi", "max_tokens": 2})
            assert status == 200
        assert not joined.engine.requests  # none of the adapter's reached it
        for _ in range(6):
            runtime.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert joined.engine.requests  # the base model's do
    finally:
        loop_thread.run(joined.stop(0))



def test_an_engine_whose_load_timed_out_is_undone_too(runtime, loop_thread):
    """The rollback also unloads where the load's answer never came (the engine may have gone on
    with it): no engine keeps an adapter the router does not list."""
    slow, refusing = runtime.decodes[0].engine, runtime.decodes[1].engine
    refusing.lora_enabled = False
    slow.lora_answer_lost = True  # it loads, but its answer is lost
    status, _, err = runtime.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"})
    assert status == 400 and runtime.decodes[1].address in err["error"]["message"]
    assert not any(e.lora_adapters for e in engines(runtime))
