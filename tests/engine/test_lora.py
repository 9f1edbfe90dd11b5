"""LoRA adapters (vLLM's --enable-lora / --lora-modules): greedy outputs token-exact against
transformers + PEFT, adapters and the base model mixed in one batch, prefix caches kept apart per
adapter, and what cannot be served refused at start, by name."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.block_hash import block_extra_keys, hash_block_tokens, hash_request_tokens, lora_key
from engine.request import InvalidRequestError

PROMPTS = [list(range(5, 25)), list(range(30, 41)), [7, 3, 9, 11, 400, 2, 18, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama, tiny_lora_factory) -> dict[str, str]:
    """Every projection at rank 8; q and v only at rank 4 with rsLoRA's scaling."""
    return {"all": tiny_lora_factory(tiny_llama, 1),
            "qv": tiny_lora_factory(tiny_llama, 2, rank=4, targets=("q_proj", "v_proj"), use_rslora=True)}


@pytest.fixture(scope="module")
def reference(tiny_llama, adapters) -> dict:
    """transformers (+ PEFT) greedy: {(adapter or None, prompt index): token ids}."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = {}
    for name in (None, *adapters):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        for i, ids in enumerate(PROMPTS):
            with torch.no_grad():
                ids_t = torch.tensor([ids])  # no token is padding (generate would guess from pad_token_id)
                gen = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=MAX_TOKENS,
                                     min_new_tokens=MAX_TOKENS, do_sample=False)
            out[(name, i)] = gen[0, len(ids):].tolist()
    return out


def greedy(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora_name=name)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_is_token_exact_against_peft_mixed_in_one_batch(tiny_llama, adapters, reference, async_scheduling,
                                                                 device):
    """On every device (make gpu-check runs the CUDA variant: LoRA there runs without CUDA graphs)."""
    llm = LLM(tiny_llama, enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()],
              async_scheduling=async_scheduling, device=device)
    # Every prompt under every adapter and none, all in one generate: one batch.
    cases = [(name, i) for name in (None, *adapters) for i in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[i] for _, i in cases], [greedy(name) for name, _ in cases])
    for (name, i), out in zip(cases, outs):
        assert out.outputs[0].token_ids == reference[(name, i)], (name, i)
    # The adapters change the answers (a test of nothing otherwise).
    assert len({tuple(reference[(name, 0)]) for name in (None, *adapters)}) == 3
    llm.engine.check_integrity(expect_all_free=True)


def test_prefix_caches_are_kept_apart_per_adapter(tiny_llama, adapters):
    llm = LLM(tiny_llama, enable_lora=True, lora_modules=[f"all={adapters['all']}"], block_size=4)
    prompt = list(range(100, 140))
    first = llm.generate([prompt], greedy("all"))[0]
    again = llm.generate([prompt], greedy("all"))[0]
    base = llm.generate([prompt], greedy(None))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0  # its own blocks, reused
    assert base.num_cached_tokens == 0  # the base model never reads the adapter's KV
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # The blocks' hashes carry vLLM's ("lora", name, path) key on every block.
    key = lora_key("all", {"all": adapters["all"]})
    assert key == ("lora", "all", adapters["all"])
    assert block_extra_keys(0, None, key) == block_extra_keys(5, None, key) == (key,)  # every block
    assert block_extra_keys(0, "s", key) == (key, ("cache_salt", "s"))  # vLLM's order
    # Each block's hash is the tokens' under that key (the first block's alone already differs).
    assert hash_request_tokens(prompt[:4], 4, lora=key) == [hash_block_tokens(None, prompt[:4], (key,))]
    assert hash_request_tokens(prompt[:4], 4, lora=key) != hash_request_tokens(prompt[:4], 4)


def test_a_name_loaded_again_from_another_path_never_reads_the_old_ones_kv(tiny_llama, adapters, reference):
    """An engine started with no adapters: "x" from one checkpoint, unloaded, then "x" from
    another: the second's answers are its own, none of the first's blocks reused (the key is the
    path's too, as in vLLM: a new version of an adapter under its old name)."""
    from engine import LoRARequest

    llm = LLM(tiny_llama, enable_lora=True, block_size=4)
    prompt = PROMPTS[0]
    first = llm.generate(prompt, greedy(None), lora_request=LoRARequest("x", 1, adapters["all"]))[0]
    assert first.outputs[0].token_ids == reference[("all", 0)]
    again = llm.generate(prompt, greedy(None), lora_request=LoRARequest("x", 1, adapters["all"]))[0]
    assert again.num_cached_tokens > 0  # the same adapter: its blocks reused
    llm.remove_lora("x")
    other = llm.generate(prompt, greedy(None), lora_request=LoRARequest("x", 2, adapters["qv"]))[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == reference[("qv", 0)]


def test_requests_for_adapters_the_engine_does_not_serve_are_refused(tiny_llama, adapters):
    llm = LLM(tiny_llama, enable_lora=True, lora_modules=[f"all={adapters['all']}"])
    with pytest.raises(InvalidRequestError, match="'other' is not an adapter this engine serves; it serves all"):
        llm.generate([PROMPTS[0]], greedy("other"))
    plain = LLM(tiny_llama)
    with pytest.raises(InvalidRequestError, match="no --enable-lora"):
        plain.generate([PROMPTS[0]], greedy("all"))
    with pytest.raises(InvalidRequestError, match="lora_name must be a non-empty string"):
        SamplingParams(lora_name="")


def test_what_cannot_be_served_is_refused_at_start(tiny_llama, adapters, tiny_lora_factory, tmp_path):
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        LLM(tiny_llama, lora_modules=[f"all={adapters['all']}"])
    with pytest.raises(ValueError, match=r"rank 8 is outside \[1, --max-lora-rank 4\]"):
        LLM(tiny_llama, enable_lora=True, lora_modules=[f"all={adapters['all']}"], max_lora_rank=4)
    with pytest.raises(ValueError, match="names an adapter twice"):
        LLM(tiny_llama, enable_lora=True, lora_modules=[f"a={adapters['all']}", f"a={adapters['qv']}"])
    with pytest.raises(ValueError, match="cannot read adapter_config.json"):
        LLM(tiny_llama, enable_lora=True, lora_modules=[f"x={tmp_path}"])
    embed = tiny_lora_factory(tiny_llama, 3, targets=("q_proj", "embed_tokens"))
    with pytest.raises(ValueError, match="embed_tokens.*not served on here"):
        LLM(tiny_llama, enable_lora=True, lora_modules=[f"e={embed}"])
    dora = tmp_path / "dora"
    shutil.copytree(adapters["qv"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    for tp in (1, 2):  # the same error under tensor parallelism (rank 0 reads it before the workers are ready)
        with pytest.raises(ValueError, match="use_dora adapters are not served"):
            LLM(tiny_llama, enable_lora=True, lora_modules=[f"d={dora}"], tensor_parallel_size=tp)
    with pytest.raises(ValueError, match="give name=path"):
        LLM(tiny_llama, enable_lora=True, lora_modules=["no-path"])
    assert os.path.isdir(adapters["all"])  # nothing above touched the good ones


@pytest.mark.parametrize("max_loras, max_cpu_loras", [(None, None), (1, None), (1, 1)])
def test_tensor_parallel_ranks_hold_their_shard_of_every_adapter(tiny_llama, adapters, reference, max_loras,
                                                                  max_cpu_loras):
    """TP=2: each rank holds B's rows of q, k, v, gate and up and A's columns of o and down (its
    delta a partial sum, all-reduced with the projection's); adapters loaded, run and unloaded at
    run time on every rank alike, and under --max-loras 1 the same adapter in the same slot on
    every rank through each swap (and with --max-cpu-loras 1 the same host copies, evicted and read
    back alike). Token-exact against PEFT, mixed in one batch."""
    llm = LLM(tiny_llama, enable_lora=True, lora_modules=[f"all={adapters['all']}"], tensor_parallel_size=2,
              max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    try:
        lora = llm.engine.runner.lora
        qkv = llm.engine.runner.model.local.layers[0].self_attn.qkv_lora
        a, bt = qkv.weights[1]
        assert a.shape[1] == 64 and bt.shape[1] == qkv.out_features < 128  # A whole; B^T rank 0's rows
        llm.engine.add_lora("qv", adapters["qv"])
        cases = [(name, i) for name in (None, "all", "qv") for i in range(len(PROMPTS))]
        outs = llm.generate([PROMPTS[i] for _, i in cases], [greedy(name) for name, _ in cases])
        assert [o.outputs[0].token_ids for o in outs] == [reference[c] for c in cases]
        assert llm.generate(PROMPTS[1], greedy("all"))[0].outputs[0].token_ids == reference[("all", 1)]
        (rank1,) = llm.engine.runner.tp.call("info")
        assert rank1["lora_slots"] == lora.slots and rank1["lora_host"] == sorted(lora.host)
        if max_loras == 1:  # qv brought into all's slot, then all into qv's
            assert lora.swaps >= 2 and len(lora.slots) == 1
        if max_cpu_loras == 1:  # all's host copy evicted for qv's, read back for its slot
            assert lora.reloads >= 1 and len(lora.host) <= 1
        llm.remove_lora("all")
        (rank1,) = llm.engine.runner.tp.call("info")
        assert "all" not in rank1["lora_slots"] and "all" not in rank1["lora_host"]
        with pytest.raises(InvalidRequestError, match="'all' is not an adapter this engine serves"):
            llm.generate([PROMPTS[0]], greedy("all"))
        assert llm.generate(PROMPTS[2], greedy("qv"))[0].outputs[0].token_ids == reference[("qv", 2)]
        with pytest.raises(ValueError, match="cannot read adapter_config.json"):
            llm.engine.add_lora("bad", os.path.dirname(adapters["qv"]))
        (rank1,) = llm.engine.runner.tp.call("info")
        assert "bad" not in rank1["lora_slots"] and "bad" not in rank1["lora_host"] and "bad" not in lora.loaded
    finally:
        llm.engine.shutdown()


def test_an_adapter_a_worker_cannot_load_is_loaded_on_no_rank(tiny_llama, adapters):
    """A worker that fails where rank 0 did not (out of memory, the files changed in between):
    rank 0 unloads it again, the worker drops what it held of it, and the worker's error is
    raised as its own kind (a LoRAOutOfMemoryError keeps its HTTP status). Under --max-cpu-loras
    rank 0's load evicted another adapter's host copy: the worker drops its copy too, so the
    ranks read it back alike. (Rank 1 here is a worker's LoRA calls on a manager in this process.)"""
    from engine.config import LoRAConfig
    from engine.lora import LoRAManager
    from engine.lora_errors import LoRAOutOfMemoryError
    from engine.parallel.layout import TPLayout
    from engine.parallel.lora import TPLoRAManager
    from engine.parallel.worker import TPWorker

    model = LLM(tiny_llama).engine.runner.model
    config = LoRAConfig(max_loras=1, max_cpu_loras=1)

    def manager():
        return LoRAManager(config, model, torch.float32, torch.device("cpu"), TPLayout.of(model.arch, 1, 0))

    class Driver:  # one worker, whose manager runs out of memory reading qv
        def __init__(self):
            self.rank1 = type("Worker", (), {"lora": manager()})()
            read = self.rank1.lora._read
            self.rank1.lora._read = lambda name, *a: (_ for _ in ()).throw(
                LoRAOutOfMemoryError("no host memory left")) if name == "qv" else read(name, *a)

        def call(self, method, *args):
            assert method == "lora_call"
            return [TPWorker.lora_call(self.rank1, *args)]

    driver = Driver()
    tp = TPLoRAManager(manager(), type("Model", (), {"driver": driver})())
    tp.add("all", adapters["all"])
    assert tp.slots == driver.rank1.lora.slots == {"all": 1} and list(driver.rank1.lora.host) == ["all"]
    with pytest.raises(LoRAOutOfMemoryError, match=r"no host memory left \(tensor-parallel rank 1\)"):
        tp.add("qv", adapters["qv"])
    for rank in (tp.local, driver.rank1.lora):
        assert rank.loaded == {"all"} and rank.slots == {"all": 1} and list(rank.host) == []
    tp.add("all2", adapters["all"])  # the ranks go on alike
    assert tp.loaded == driver.rank1.lora.loaded == {"all", "all2"}
    assert list(tp.host) == list(driver.rank1.lora.host) == ["all2"]


def test_vllms_json_form_of_lora_modules(tiny_llama, adapters, reference):
    spec = json.dumps({"name": "qv", "path": adapters["qv"], "base_model_name": "tiny"})
    llm = LLM(tiny_llama, enable_lora=True, lora_modules=[spec])
    assert llm.generate([PROMPTS[1]], greedy("qv"))[0].outputs[0].token_ids == reference[("qv", 1)]


def test_max_loras_caps_the_adapters_a_step_runs(tiny_llama, adapters, reference):
    """vLLM's --max-loras: a request for one adapter too many is passed over (keeping its place)
    until the running requests of another have all finished; answers are the same."""
    from engine.config import SchedulerConfig
    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request
    from engine.scheduler import ModelOutput, Scheduler

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), KVCacheManager(num_blocks=64, block_size=16),
                          max_model_len=512, max_loras=1)
    names = ["all", "qv", None, "all", "qv"]
    for i, name in enumerate(names):
        scheduler.add_request(Request(str(i), list(range(10, 20)), SamplingParams(max_tokens=3, ignore_eos=True,
                                                                                  lora_name=name)))
    seen = []
    while scheduler.requests:
        out = scheduler.schedule()
        adapters_in_step = {r.sampling_params.lora_name for r in out.scheduled} - {None}
        assert len(adapters_in_step) <= 1, adapters_in_step
        seen.append([r.request_id for r in out.scheduled])
        sampled = [5] * sum(1 for r, n in zip(out.scheduled, out.num_scheduled_tokens)
                            if r.num_computed_tokens + n >= r.num_tokens)
        scheduler.update_from_output(out, ModelOutput(sampled))
    # "qv" (1 and 4) is passed over while "all" runs; the base model and "all" behind it go on.
    assert seen[0] == ["0", "2", "3"]
    first = next(step for step in seen if "1" in step)  # once "all" has no request left, in order
    assert first[:2] == ["1", "4"] and "0" not in first and "3" not in first
    llm = LLM(tiny_llama, enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()], max_loras=1)
    cases = [(name, i) for name in ("all", "qv", None) for i in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[i] for _, i in cases], [greedy(name) for name, _ in cases])
    assert [o.outputs[0].token_ids for o in outs] == [reference[c] for c in cases]


async def _tokens(engine, prompt, params) -> list[int]:
    out = []
    async for o in engine.generate(prompt, params):
        out += o.delta_token_ids
    return out


@pytest.mark.parametrize("multiprocess", [False, True], ids=["thread", "process"])
def test_adapters_load_and_unload_at_run_time(tiny_llama, adapters, reference, multiprocess, tmp_path):
    """vLLM's runtime load / unload: an engine started with --enable-lora and no adapter serves
    each one token-exact once it is loaded, refuses it once unloaded, and keeps serving through
    every refused call."""
    from engine.async_engine import AsyncEngine
    from engine.lora_errors import (LoRAAdapterError, LoRAAdapterExistsError, LoRAAdapterNotFoundError,
                             LoRANotEnabledError)

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=multiprocess, enable_lora=True)
        try:
            with pytest.raises(InvalidRequestError, match="'all' is not an adapter this engine serves; it serves none"):
                await _tokens(engine, PROMPTS[0], greedy("all"))
            assert await engine.load_lora_adapter("all", adapters["all"]) is True
            assert await _tokens(engine, PROMPTS[0], greedy("all")) == reference[("all", 0)]
            assert await engine.load_lora_adapter("all", adapters["all"]) is False  # had it: nothing to do
            with pytest.raises(LoRAAdapterExistsError, match="'all' is already loaded"):
                await engine.load_lora_adapter("all", adapters["qv"])
            (tmp_path / "adapter_config.json").write_text('{"peft_type": "IA3"}')
            with pytest.raises(LoRAAdapterError, match="only LORA adapters are served"):
                await engine.load_lora_adapter("ia3", str(tmp_path))
            with pytest.raises(LoRAAdapterError, match="cannot read adapter_config.json"):
                await engine.load_lora_adapter("nowhere", str(tmp_path / "missing"))
            assert set(engine.lora_adapters) == {"all"}  # the failed loads left nothing behind
            await engine.load_lora_adapter("qv", adapters["qv"])
            cases = [(name, i) for name in (None, "all", "qv") for i in range(len(PROMPTS))]
            got = await asyncio.gather(*(_tokens(engine, PROMPTS[i], greedy(name)) for name, i in cases))
            assert got == [reference[case] for case in cases]  # one batch, three models
            await engine.unload_lora_adapter("all")
            with pytest.raises(InvalidRequestError, match="'all' is not an adapter this engine serves; it serves qv"):
                await _tokens(engine, PROMPTS[0], greedy("all"))
            with pytest.raises(LoRAAdapterNotFoundError, match="'all' is not loaded"):
                await engine.unload_lora_adapter("all")
            assert await _tokens(engine, PROMPTS[1], greedy("qv")) == reference[("qv", 1)]
            await engine.load_lora_adapter("all", adapters["all"])  # into the slot it left
            assert await _tokens(engine, PROMPTS[2], greedy("all")) == reference[("all", 2)]
        finally:
            await engine.shutdown()
        plain = await AsyncEngine.create(tiny_llama, multiprocess=multiprocess)
        try:
            with pytest.raises(LoRANotEnabledError, match="start it with --enable-lora"):
                await plain.load_lora_adapter("all", adapters["all"])
        finally:
            await plain.shutdown()

    asyncio.run(main())


def test_unloading_lets_the_adapters_running_requests_finish(tiny_llama, adapters):
    """Unloaded mid-generation, an adapter's request finishes on it, token-exact, while new requests
    for it are refused; its slot frees once the request is done, and the name loads again."""
    from engine.async_engine import AsyncEngine
    from engine.lora_errors import LoRAAdapterBusyError

    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, lora_name="all")
    expected = LLM(tiny_llama, enable_lora=True, lora_modules=[f"all={adapters['all']}"]).generate(
        [PROMPTS[0]], long)[0].outputs[0].token_ids

    async def main():
        engine = await AsyncEngine.create(tiny_llama, enable_lora=True, lora_modules=[f"all={adapters['all']}"])
        core = engine.client.core  # in a thread: its slots can be looked at
        try:
            stream = engine.generate(PROMPTS[0], long)
            first = await stream.__anext__()
            await engine.unload_lora_adapter("all")
            with pytest.raises(InvalidRequestError, match="'all' is not an adapter this engine serves"):
                await _tokens(engine, PROMPTS[1], greedy("all"))
            assert "all" in core.runner.lora.slots  # still running on it
            with pytest.raises(LoRAAdapterBusyError, match="still has requests to finish"):
                await engine.load_lora_adapter("all", adapters["all"])
            tokens = list(first.delta_token_ids)
            async for out in stream:
                tokens += out.delta_token_ids
            assert tokens == expected
            for _ in range(100):  # freed at the end of the step that finished it
                if "all" not in core.runner.lora.slots:
                    break
                await asyncio.sleep(0.01)
            assert core.runner.lora.slots == {} and core.lora_paths == {}
            assert all(not layer.weights for modules in core.runner.lora.layers.values() for layer in modules.values())
            await engine.load_lora_adapter("all", adapters["all"])
            assert await _tokens(engine, PROMPTS[0], greedy("all")) == expected[:MAX_TOKENS]
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_the_offline_api_loads_a_lora_request_on_first_use(tiny_llama, adapters, reference):
    """vLLM's LLM.generate(..., lora_request=LoRARequest(name, id, path)): the adapter loads the
    first time it is named, one per prompt or one for all, beside the base model in a batch."""
    from engine import LoRARequest
    from engine.lora_errors import LoRAAdapterNotFoundError, LoRANotEnabledError

    llm = LLM(tiny_llama, enable_lora=True)
    all_, qv = LoRARequest("all", 1, adapters["all"]), LoRARequest("qv", 2, adapters["qv"])
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], greedy(None), lora_request=[all_, None, qv])
    assert [o.outputs[0].token_ids for o in outs] == [reference[("all", 0)], reference[(None, 1)],
                                                      reference[("qv", 2)]]
    outs = llm.generate(PROMPTS[1], greedy(None), lora_request=all_)  # loaded already: used as it is
    assert outs[0].outputs[0].token_ids == reference[("all", 1)]
    with pytest.raises(ValueError, match="'all' is loaded from .*, not .*: give another adapter another name"):
        llm.generate(PROMPTS[0], greedy(None), lora_request=LoRARequest("all", 1, adapters["qv"]))
    with pytest.raises(ValueError, match="one lora_request per prompt"):
        llm.generate([PROMPTS[0], PROMPTS[1]], greedy(None), lora_request=[all_])
    llm.remove_lora("all")
    with pytest.raises(InvalidRequestError, match="'all' is not an adapter this engine serves; it serves qv"):
        llm.generate(PROMPTS[0], greedy("all"))
    with pytest.raises(LoRAAdapterNotFoundError):
        llm.remove_lora("all")
    assert llm.generate(PROMPTS[2], greedy(None), lora_request=all_)[0].outputs[0].token_ids == reference[("all", 2)]
    llm.engine.check_integrity(expect_all_free=True)
    with pytest.raises(LoRANotEnabledError, match="enable_lora=True"):
        LLM(tiny_llama).generate(PROMPTS[0], greedy(None), lora_request=all_)
    with pytest.raises(ValueError, match="needs a lora_name and a lora_path"):
        LoRARequest("x", 1)



def test_a_load_whose_caller_leaves_still_completes_and_is_known(tiny_llama, adapters, reference):
    """A router's call cut off (its deadline, a client gone) while the core loads: the front end
    still learns the adapter is loaded, so it serves it and a second load is no conflict."""
    from engine.async_engine import AsyncEngine

    async def main():
        engine = await AsyncEngine.create(tiny_llama, enable_lora=True, multiprocess=True)
        try:
            caller = asyncio.create_task(engine.load_lora_adapter("all", adapters["all"]))
            await asyncio.sleep(0)  # sent to the core
            caller.cancel()
            for _ in range(500):
                if "all" in engine.lora_adapters:
                    break
                await asyncio.sleep(0.02)
            assert engine.lora_adapters == {"all": adapters["all"]}
            assert await engine.load_lora_adapter("all", adapters["all"]) is False
            assert await _tokens(engine, PROMPTS[0], greedy("all")) == reference[("all", 0)]
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_load_that_fails_half_way_leaves_no_part_of_it(tiny_llama, adapters, reference, monkeypatch):
    """Out of device memory on its third projection: a LoRAOutOfMemoryError (the router's 503),
    and no layer keeps the first two for the next adapter in that slot."""
    from engine.lora import LoRALayer
    from engine.lora_errors import LoRAOutOfMemoryError

    llm = LLM(tiny_llama, enable_lora=True)
    added, put = [], LoRALayer.put

    def short_of_memory(layer, slot, pair):
        added.append(slot)
        if len(added) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        put(layer, slot, pair)

    monkeypatch.setattr(LoRALayer, "put", short_of_memory)
    with pytest.raises(LoRAOutOfMemoryError, match="'all': no device memory left"):
        llm.engine.add_lora("all", adapters["all"])
    monkeypatch.undo()
    lora = llm.engine.runner.lora
    assert lora.slots == {} and all(not layer.weights for m in lora.layers.values() for layer in m.values())
    assert "all" not in llm.lora_adapters
    out = llm.generate(PROMPTS[0], greedy(None), lora_request=LoRARequest("qv", 1, adapters["qv"]))  # slot 1 again
    assert out[0].outputs[0].token_ids == reference[("qv", 0)]


def _slot_bytes(arch, max_rank: int, element_size: int) -> int:
    """One --max-loras slot: per layer and fused projection, A [targets x rank, in] and
    B^T [targets x rank, out]."""
    h, q, kv, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    per_layer = 3 * max_rank * (h + q + 2 * kv) + max_rank * (q + h) + 2 * max_rank * (h + 2 * i) + max_rank * (i + h)
    return arch.num_layers * per_layer * element_size


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_max_loras_slots_are_taken_at_start_and_adapters_beyond_them_wait_in_host_memory(
        tiny_llama, adapters, reference, async_scheduling):
    """vLLM's --max-loras memory rule: N slots at --max-lora-rank allocated before the KV cache is
    sized, whatever is loaded later; more adapters than slots load (host memory) and each comes to
    the device for the steps that run it, in place of the one run least recently: every answer
    token-exact against PEFT, the moves counted."""
    from engine.lora_errors import LoRAAdapterNotFoundError

    llm = LLM(tiny_llama, enable_lora=True, max_loras=1, lora_modules=[f"all={adapters['all']}"],
              async_scheduling=async_scheduling)
    lora = llm.engine.runner.lora
    slot = _slot_bytes(lora.arch, 16, 4)
    assert lora.device_bytes() == slot  # one slot at --max-lora-rank 16, float32
    assert lora.slots == {"all": 1} and set(lora.host) == {"all"}  # a free slot: on the device at once
    llm.engine.add_lora("qv", adapters["qv"])  # no slot left: held in host memory
    assert lora.slots == {"all": 1} and set(lora.host) == {"all", "qv"} and lora.device_bytes() == slot
    order = [("qv", 0), ("all", 1), ("qv", 2), (None, 0), ("all", 0)]
    for name, i in order:
        assert llm.generate(PROMPTS[i], greedy(name))[0].outputs[0].token_ids == reference[(name, i)]
    stats = llm.engine.stats()
    assert stats["lora_swaps"] == 4 and stats["lora_adapters_on_device"] == 1  # qv, all, qv, (base), all
    # Every prompt under both adapters and none in one generate: the scheduler runs one adapter at
    # a time, the slot changes hands between them.
    cases = [(name, i) for name in ("all", "qv", None) for i in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[i] for _, i in cases], [greedy(name) for name, _ in cases])
    assert [o.outputs[0].token_ids for o in outs] == [reference[c] for c in cases]
    assert lora.device_bytes() == slot
    llm.remove_lora("qv")  # on the device or not, its memory goes
    llm.remove_lora("all")
    assert lora.slots == {} and lora.host == {} and lora.device_bytes() == slot
    with pytest.raises(LoRAAdapterNotFoundError):
        llm.remove_lora("qv")
    llm.engine.add_lora("qv", adapters["qv"])  # the free slot again
    assert lora.slots == {"qv": 1}
    assert llm.generate(PROMPTS[1], greedy("qv"))[0].outputs[0].token_ids == reference[("qv", 1)]
    llm.engine.check_integrity(expect_all_free=True)


def test_without_max_loras_each_adapter_takes_its_own_device_memory(tiny_llama, adapters):
    """No cap: adapters live on the device as loaded, at their own ranks (nothing reserved)."""
    llm = LLM(tiny_llama, enable_lora=True)
    lora = llm.engine.runner.lora
    assert lora.device_bytes() == 0
    llm.engine.add_lora("all", adapters["all"])  # rank 8 on every projection
    assert lora.device_bytes() == _slot_bytes(lora.arch, 8, 4) and lora.host == {}
    llm.engine.add_lora("qv", adapters["qv"])  # rank 4 on q and v: A [8, h], B^T [8, q + 2 kv]
    arch = lora.arch
    qkv = arch.num_heads * arch.head_dim + 2 * arch.num_kv_heads * arch.head_dim
    assert lora.device_bytes() == _slot_bytes(arch, 8, 4) + arch.num_layers * 8 * (arch.hidden_size + qkv) * 4
    assert lora.slots == {"all": 1, "qv": 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_max_loras_slots_come_out_of_the_share_before_the_kv_cache(tiny_llama, adapters, reference):
    """--gpu-memory-utilization with --max-loras: the slots are allocated before the KV cache is
    sized (what is not KV cache grows by their bytes), adapters come in from pinned host memory
    token-exact, and loading more does not take device memory."""
    import gc

    def engine(**kwargs) -> LLM:
        return LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.3, enable_lora=True, **kwargs)

    plain = engine().engine.runner.memory_budget.non_kv
    gc.collect()
    torch.cuda.empty_cache()
    llm = engine(max_loras=32, max_lora_rank=64)
    lora = llm.engine.runner.lora
    assert llm.engine.runner.memory_budget.non_kv - plain >= 0.9 * lora.device_bytes() > 0
    slots = lora.device_bytes()
    for name, path in adapters.items():
        llm.engine.add_lora(name, path)
    cases = [(name, i) for name in ("all", "qv", None) for i in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[i] for _, i in cases], [greedy(name) for name, _ in cases])
    assert [o.outputs[0].token_ids for o in outs] == [reference[c] for c in cases]
    assert lora.device_bytes() == slots and all(t.is_pinned() for pair in lora.host["all"].values() for t in pair)


def test_max_cpu_loras_keeps_that_many_in_host_memory_and_reads_the_others_back(tiny_llama, adapters, reference,
                                                                                 tmp_path):
    """vLLM's --max-cpu-loras: M adapters at most in host memory, the one run least recently
    evicted beyond them and read back from its files when a request runs it again (every answer
    token-exact against PEFT); one whose files are gone, or changed, by then fails its requests
    with the reason and stays loaded (the next request tries again), the engine serving the rest."""
    from engine.config import LoRAConfig

    with pytest.raises(ValueError, match="--max-cpu-loras needs --max-loras"):
        LoRAConfig(max_cpu_loras=2)
    with pytest.raises(ValueError, match=r"--max-cpu-loras \(1\) must be >= --max-loras \(2\)"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)
    qv = shutil.copytree(adapters["qv"], tmp_path / "qv")
    llm = LLM(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=1,
              lora_modules=[f"all={adapters['all']}", f"qv={qv}"])
    lora = llm.engine.runner.lora
    assert lora.slots == {"all": 1} and list(lora.host) == ["qv"]  # "all" runs from its slot, its host copy gone
    order = [("all", 0), ("qv", 1), ("all", 2), (None, 0), ("qv", 0), ("all", 1)]
    for name, i in order:
        assert llm.generate(PROMPTS[i], greedy(name))[0].outputs[0].token_ids == reference[(name, i)]
        assert len(lora.host) <= 1
    stats = llm.engine.stats()
    # "all" read back for its slot after qv's turns (twice), qv after all's (once: its second turn)
    assert stats["lora_reloads"] == 3 and stats["lora_adapters_in_host_memory"] == 1
    cases = [(name, i) for name in ("all", "qv") for i in range(len(PROMPTS))]  # both, one batch's worth
    outs = llm.generate([PROMPTS[i] for _, i in cases], [greedy(name) for name, _ in cases])
    assert [o.outputs[0].token_ids for o in outs] == [reference[c] for c in cases] and len(lora.host) <= 1
    # qv's files removed while "all" holds the slot and the host copy: qv's requests fail, named.
    assert llm.generate(PROMPTS[0], greedy("all"))[0].outputs[0].token_ids == reference[("all", 0)]
    assert list(lora.host) == ["all"] and lora.slots == {"all": 1}
    shutil.rmtree(qv)
    out = llm.generate(PROMPTS[1], greedy("qv"))[0].outputs[0]
    assert out.finish_reason == "abort" and "could not be read back" in out.stop_reason and str(qv) in out.stop_reason
    assert "qv" in llm.engine.lora_paths and "qv" in lora.loaded  # still loaded: a later request tries again
    assert llm.generate(PROMPTS[2], greedy("all"))[0].outputs[0].token_ids == reference[("all", 2)]
    assert llm.generate(PROMPTS[2], greedy(None))[0].outputs[0].token_ids == reference[(None, 2)]
    # Files back, but not those it loaded (another adapter's, or the same written again): refused
    # by name, never served as "qv" (its prefix-cache entries are keyed by its name and path).
    shutil.copytree(adapters["all"], qv)
    out = llm.generate(PROMPTS[1], greedy("qv"))[0].outputs[0]
    assert out.finish_reason == "abort" and "changed since it was loaded" in out.stop_reason
    llm.remove_lora("qv")  # loaded again: the files it finds now
    shutil.rmtree(qv)
    shutil.copytree(adapters["qv"], qv)
    llm.engine.add_lora("qv", str(qv))
    assert llm.generate(PROMPTS[1], greedy("qv"))[0].outputs[0].token_ids == reference[("qv", 1)]
    llm.engine.check_integrity(expect_all_free=True)


# Phi-3 stores qkv_proj and gate_up_proj fused, and PEFT adapts them as such: each is served as its
# parts' adapters (the same A, B cut by rows). Arcee's MLP is plain (no gate): its up_proj's adapter
# takes the whole of the MLP's input projection.
ADAPTED_FAMILIES = {
    "phi3-fused": (dict(arch="phi3", config={"partial_rotary_factor": 0.75}),
                   ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "arcee-plain-mlp": (dict(arch="arcee"), ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")),
    # Other families' module names (PEFT's defaults for them): Phi's dense / fc1 / fc2, StarCoder 2's
    # c_fc / c_proj, GPT-NeoX's query_key_value (each head's q, k, v rows in turn) and its MLP's.
    "phi-names": (dict(arch="phi"), ("q_proj", "v_proj", "dense", "fc1", "fc2")),
    "starcoder2-names": (dict(arch="starcoder2"), ("q_proj", "o_proj", "c_fc", "c_proj")),
    "gpt-neox-names": (dict(arch="gpt_neox", num_kv_heads=4),
                       ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")),
}


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("family", list(ADAPTED_FAMILIES))
def test_adapters_of_fused_and_plain_projections_are_token_exact_against_peft(
        tiny_model_factory, tiny_lora_factory, family, tensor_parallel_size):
    """At TP=1 and split over two ranks."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_kwargs, targets = ADAPTED_FAMILIES[family]
    base = tiny_model_factory(**model_kwargs)
    adapter = tiny_lora_factory(base, 3, targets=targets)
    expected = {}
    for name in (None, "ad"):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = (PeftModel.from_pretrained(model, adapter) if name else model).eval()
        model.generation_config.eos_token_id = None  # as ignore_eos: run on past an end token
        for i, ids in enumerate(PROMPTS):
            ids_t = torch.tensor([ids])
            with torch.no_grad():
                gen = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, pad_token_id=0)
            expected[(name, i)] = gen[0, len(ids):].tolist()
    assert expected[(None, 0)] != expected[("ad", 0)], "the adapter changes the answer"
    llm = LLM(base, enable_lora=True, lora_modules=[f"ad={adapter}"], tensor_parallel_size=tensor_parallel_size,
              num_blocks=256)
    try:
        cases = [(name, i) for name in (None, "ad") for i in range(len(PROMPTS))]
        outs = llm.generate([PROMPTS[i] for _, i in cases], [greedy(name) for name, _ in cases])
        assert {case: out.outputs[0].token_ids for case, out in zip(cases, outs)} == expected
        llm.engine.check_integrity(expect_all_free=True)
    finally:
        llm.engine.shutdown()
