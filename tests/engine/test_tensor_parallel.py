"""Tensor parallelism (TP=2 over gloo on the CPU): greedy outputs token-exact against TP=1 and
transformers for every architecture, each rank's KV shard, clear errors, no orphaned workers."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from engine import LLM, SamplingParams
from engine.parallel import check_tensor_parallel_size
from test_hf_exact import MAX_NEW, Reference, mixed_prompts, run, shared_prefix_prompts

# Tiny models: 4 query heads; KV heads split (2 -> 1 per rank) or replicated (1 -> 1 per rank).
VARIANTS = {
    "llama-gqa": dict(arch="llama"),
    "mistral": dict(arch="mistral"),
    # 1999 tokens: the last rank's vocabulary shard is zero-padded; the LM head is the embedding.
    "qwen2-tied-qkv-bias": dict(arch="qwen2", tie_word_embeddings=True, vocab_size=1999),
    "qwen3-qk-norm": dict(arch="qwen3"),
    "llama-1-kv-head": dict(arch="llama", num_kv_heads=1),
    # o_proj and down_proj biases: row-parallel, added once (by rank 0) before the all-reduce.
    "llama-o-mlp-bias": dict(arch="llama", biases=True),
    # Mixtures of experts: every expert's intermediate split, the router replicated; Qwen2-MoE's
    # shared expert split too and reduced with the routed experts.
    "mixtral": dict(arch="mixtral"),
    "qwen2-moe-shared": dict(arch="qwen2_moe"),
    # Phi-3's fused qkv_proj / gate_up_proj: each rank reads its rows of every part; Granite's multipliers.
    "phi3-fused-partial-rotary": dict(arch="phi3", config={"partial_rotary_factor": 0.75}),
    "granite": dict(arch="granite"),
    "granite-moe": dict(arch="granitemoe"),
    "seed-oss-biases": dict(arch="seed_oss"),
    # q and k normalised over all heads: the squares summed over the ranks (a replicated KV head once).
    "olmo2": dict(arch="olmo2"),
    "olmo2-1-kv-head": dict(arch="olmo2", num_kv_heads=1),
    "olmoe": dict(arch="olmoe"),
    "gemma": dict(arch="gemma"),
    "mistral-sliding-window": dict(arch="mistral", config={"sliding_window": 48}),
    "gemma2": dict(arch="gemma2", config={"sliding_window": 40, "attn_logit_softcapping": 5.0,
                                          "final_logit_softcapping": 3.0}),
    "gemma3": dict(arch="gemma3_text", config={"sliding_window": 40}),
    "olmo3": dict(arch="olmo3", config={"sliding_window": 40, "layer_types": ["sliding_attention", "full_attention"]}),
    "exaone4": dict(arch="exaone4", config={"sliding_window": 40, "sliding_window_pattern": 2}),
    "glm4": dict(arch="glm4"),
    "ernie4_5-biases": dict(arch="ernie4_5", config={"use_bias": True}),
    # Command R+'s q / k norms: each rank holds its heads' rows of the weights.
    "cohere-qk-norm": dict(arch="cohere", config={"use_qk_norm": True}),
    "cohere-qk-norm-1-kv-head": dict(arch="cohere", num_kv_heads=1, config={"use_qk_norm": True}),
    "cohere2": dict(arch="cohere2", config={"sliding_window": 40, "layer_types": ["sliding_attention", "full_attention"]}),
    "hunyuan": dict(arch="hunyuan_v1_dense"),
    # Plain MLPs: each rank its rows of up_proj, its columns of down_proj; LayerNorms' biases replicated.
    "nemotron-biases": dict(arch="nemotron", config={"attention_bias": True, "mlp_bias": True}),
    "starcoder2": dict(arch="starcoder2"),
    "apertus": dict(arch="apertus"),
    # Phi's LM head bias: each rank its vocabulary rows of it (the last rank's zero-padded).
    "phi-odd-vocab": dict(arch="phi", vocab_size=1999),
    # GPT-NeoX's fused query_key_value: each rank its heads' q, k and v rows.
    "gpt-neox": dict(arch="gpt_neox", num_kv_heads=4),
}
BLOCKS = dict(num_blocks=512)
CONFIGS = {
    "plain": BLOCKS,
    # Chunked prefill, decode steps padded to 1/2/4/8 rows (the CUDA graph path, run eagerly),
    # and async scheduling (the forward command carries the ids the driver read).
    "chunked-padded-async": dict(BLOCKS, max_num_batched_tokens=48, cuda_graph_sizes=[8], async_scheduling=True),
    "preempted": dict(num_blocks=23),
    "chunked-preempted": dict(num_blocks=23, max_num_batched_tokens=48),
    "ngram-spec": dict(BLOCKS, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    # The draft (here the target's own checkpoint) is split over the ranks as the target is.
    "draft-model": dict(BLOCKS, speculative_config={"method": "draft_model", "num_speculative_tokens": 2}),
}
CASES = [("llama-gqa", "plain"), ("llama-gqa", "chunked-padded-async"), ("llama-gqa", "preempted"),
         ("llama-gqa", "draft-model"),
         ("mistral", "chunked-preempted"), ("qwen2-tied-qkv-bias", "chunked-preempted"),
         ("qwen3-qk-norm", "chunked-preempted"), ("llama-o-mlp-bias", "plain"), ("mixtral", "chunked-preempted"),
         ("qwen2-moe-shared", "chunked-padded-async"), ("llama-1-kv-head", "ngram-spec"),
         ("phi3-fused-partial-rotary", "chunked-preempted"), ("granite", "chunked-padded-async"),
         ("granite-moe", "chunked-preempted"), ("seed-oss-biases", "plain"), ("olmo2", "chunked-padded-async"),
         ("olmo2-1-kv-head", "draft-model"), ("olmoe", "chunked-preempted"), ("gemma", "chunked-padded-async"),
         ("mistral-sliding-window", "chunked-preempted"), ("gemma2", "chunked-padded-async"),
         ("gemma3", "chunked-preempted"), ("olmo3", "chunked-padded-async"), ("exaone4", "chunked-preempted"),
         ("glm4", "chunked-padded-async"), ("ernie4_5-biases", "chunked-preempted"),
         ("cohere-qk-norm", "chunked-padded-async"), ("cohere-qk-norm-1-kv-head", "preempted"),
         ("cohere2", "chunked-preempted"), ("hunyuan", "chunked-padded-async"),
         ("nemotron-biases", "chunked-preempted"), ("starcoder2", "chunked-padded-async"),
         ("apertus", "chunked-preempted"), ("phi-odd-vocab", "chunked-padded-async"),
         ("gpt-neox", "chunked-preempted")]


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.runner.tp.procs]


def shutdown(llm: LLM) -> None:
    pids = worker_pids(llm)
    llm.engine.shutdown()
    assert not [p for p in pids if alive(p)], "tensor-parallel workers outlived their engine"


def with_random_biases(path: str) -> str:
    """A copy of a tiny Llama with attention_bias and mlp_bias, every bias random (transformers
    initialises them to zero, which would hide a bias added on every rank)."""
    import shutil

    import transformers

    out = path.rstrip("/") + "-biases"
    if not os.path.exists(os.path.join(out, "config.json")):
        shutil.copytree(path, out, dirs_exist_ok=True)
        config = transformers.LlamaConfig.from_pretrained(path, attention_bias=True, mlp_bias=True)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        model.save_pretrained(out)
    return out


class Engines:
    """TP=1 and TP=2 engines and transformers per variant, made on demand; another variant's
    TP=2 engines are shut down first (each holds a worker process)."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.variant: str | None = None
        self.tp2: dict[str, LLM] = {}
        self.ref: Reference | None = None

    def path(self, variant: str) -> str:
        spec = dict(VARIANTS[variant])
        biases = spec.pop("biases", False)
        path = self.factory(max_position_embeddings=1024, **spec)
        return with_random_biases(path) if biases else path

    def get(self, variant: str, config: str) -> tuple[LLM, Reference]:
        if variant != self.variant:
            self.close()
            self.variant, self.ref = variant, Reference(self.path(variant))
        if config not in self.tp2:
            self.tp2[config] = LLM(self.path(variant), device="cpu", tensor_parallel_size=2,
                                   **self.kwargs(variant, config))
        return self.tp2[config], self.ref

    def kwargs(self, variant: str, config: str) -> dict:
        kwargs = dict(CONFIGS[config])
        if config == "draft-model":
            kwargs["speculative_config"] = dict(kwargs["speculative_config"], model=self.path(variant))
        return kwargs

    def tp1(self, variant: str, config: str) -> LLM:
        return LLM(self.path(variant), device="cpu", **self.kwargs(variant, config))

    def close(self) -> None:
        for llm in self.tp2.values():
            shutdown(llm)
        self.tp2.clear()


@pytest.fixture(scope="module")
def engines(tiny_model_factory):
    pool = Engines(tiny_model_factory)
    yield pool
    pool.close()


# The tests run in this file's order, which keeps each variant's engines together.

def test_prefix_cache_hits_are_exact(engines):
    llm, ref = engines.get("llama-gqa", "plain")
    prompts = shared_prefix_prompts(ref.model.config.vocab_size)
    expected = [ref.generate(p) for p in prompts]
    hits = llm.engine.kv_cache_manager.prefix_hits
    assert run(llm, prompts) == expected
    assert llm.engine.kv_cache_manager.prefix_hits > hits, "later prompts share a 200-token prefix"
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for prompt, out in zip(prompts, outputs):  # the second pass: every full block from the cache
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    llm.engine.check_integrity(expect_all_free=True)


def test_seeded_sampling_repeats(engines):
    llm, ref = engines.get("llama-gqa", "plain")
    prompts = mixed_prompts(ref.model.config.vocab_size, seed=5)[:4]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert first == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_logprobs_and_prompt_logprobs_match_tp1(engines):
    """Prompt logprobs score every prompt position through the gathered LM head shards."""
    llm, ref = engines.get("llama-gqa", "plain")
    prompts = mixed_prompts(ref.model.config.vocab_size, seed=9)[2:5]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    tp2, tp1 = (llm.generate(prompts, params), engines.tp1("llama-gqa", "plain").generate(prompts, params))
    for a, b in zip(tp2, tp1):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in ((a.prompt_logprobs, b.prompt_logprobs), (a.outputs[0].logprobs, b.outputs[0].logprobs)):
            assert len(got) == len(want) > 0
            for g, w in zip(got, want):
                assert list(g) == list(w)  # the same tokens, in the same order
                assert [g[t] for t in g] == pytest.approx([w[t] for t in w], abs=1e-4)


@pytest.mark.parametrize("variant,config", CASES, ids=[f"{v}-{c}" for v, c in CASES])
def test_greedy_tp2_matches_tp1_and_transformers(engines, variant, config):
    llm, ref = engines.get(variant, config)
    prompts = mixed_prompts(ref.model.config.vocab_size)
    expected = [ref.generate(p) for p in prompts]
    tp2 = run(llm, prompts)
    assert tp2 == run(engines.tp1(variant, config), prompts)
    assert tp2 == expected
    core = llm.engine
    assert core.runner.cuda_graphs_off_reason == "tensor parallelism"
    if "preempted" in config:
        assert core.scheduler.num_preemptions > 0, "the tiny KV pool should force preemption"
    if "padded" in config:
        assert core.runner.decode_graphs.sizes == [1, 2, 4, 8] and core.runner.decode_graphs.num_steps > 0
    if "async" in config:
        assert core.num_async_steps > 0
    if "spec" in config or "draft" in config:
        assert core.stats()["spec_decode_num_draft_tokens"] > 0
    if config == "draft-model":  # its own checkpoint as the draft: every proposal is accepted
        assert core.stats()["spec_decode_acceptance_rate"] > 0.9
    core.check_integrity(expect_all_free=True)
    # Each rank's KV shard: its half of the KV heads (GPT-NeoX's 4: two a rank; 2: one), or 1
    # replicated (on both); every rank has the driver's block count.
    (worker,) = core.runner.tp.call("info")
    shard = (2, core.runner.num_blocks, 16, max(1, VARIANTS[variant].get("num_kv_heads", 2) // 2), 16)
    assert tuple(core.runner.kv_caches[0].shape) == worker["kv_cache_shape"] == shard
    assert worker["rank"] == 1 and worker["pid"] == core.runner.tp.procs[0].pid and worker["threads"] == 1
    with pytest.raises(RuntimeError, match="tensor-parallel worker rank 1: AttributeError"):
        core.runner.tp.call("no_such_method")
    assert core.runner.tp.call("info") == [worker]  # a failed call leaves no reply behind


def test_an_fp8_cache_is_every_ranks(tiny_model_factory):
    """--kv-cache-dtype fp8 under tensor parallelism: each rank's shard is 8-bit, and the
    answers are TP=1's with the same cache, token for token."""
    path = tiny_model_factory("llama", max_position_embeddings=1024)
    prompts = mixed_prompts(500)
    llm = LLM(path, device="cpu", tensor_parallel_size=2, kv_cache_dtype="fp8", **BLOCKS)
    try:
        (worker,) = llm.engine.runner.tp.call("info")
        assert worker["kv_cache_dtype"] == "float8_e4m3fn" and llm.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        assert run(llm, prompts) == run(LLM(path, device="cpu", kv_cache_dtype="fp8", **BLOCKS), prompts)
    finally:
        shutdown(llm)


def test_a_draft_model_is_split_as_the_target(tiny_model_factory, caplog):
    """Speculation with a draft model at TP=2: every rank holds its shard of the draft and its
    share of the draft cache (a block's bytes count the rank's draft KV heads, not all of them),
    and greedy answers are plain decoding's. A draft the size cannot split (3 heads) runs whole on
    rank 0, said at start, with the same answers."""
    path = tiny_model_factory("llama", max_position_embeddings=1024)
    draft = tiny_model_factory("llama", num_layers=1, max_position_embeddings=1024)  # 4 heads, 2 KV heads
    odd = tiny_model_factory("llama", num_layers=1, hidden_size=48, num_heads=3, num_kv_heads=3,
                             max_position_embeddings=1024)
    prompts = mixed_prompts(300)
    want = run(LLM(path, device="cpu", **BLOCKS), prompts)
    for model, split in ((draft, True), (odd, False)):
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
        caplog.clear()
        llm = LLM(path, device="cpu", tensor_parallel_size=2, speculative_config=spec, **BLOCKS)
        try:
            runner = llm.engine.runner
            (worker,) = runner.tp.call("info")
            heads = runner.draft.kv_caches[0].shape[3]
            assert heads == (1 if split else 3) and (runner.draft.layout is not None) == split
            # K and V, 16 slots of 16 values in float32, a layer: 1 KV head of 2 here, or all 3 whole.
            assert runner.draft.bytes_per_block(16, torch.float32) == 2 * 16 * 16 * 4 * heads
            assert ("draft_kv_cache_shape" in worker) == split
            if split:
                assert worker["draft_kv_cache_shape"] == tuple(runner.draft.kv_caches[0].shape)
                assert runner.draft.model.local.layers[0].self_attn.q_size == 2 * 16  # 2 of its 4 heads
            else:
                assert "the draft model cannot be split over 2 ranks (tensor_parallel_size=2 does not divide " \
                       "the model's 3 attention heads)" in caplog.text
            assert run(llm, prompts) == want
            assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0
        finally:
            shutdown(llm)


def test_a_killed_worker_fails_the_engine(engines):
    llm, ref = engines.get("llama-1-kv-head", "ngram-spec")  # the last variant: this engine is done for
    engines.tp2.pop("ngram-spec")
    (pid,) = worker_pids(llm)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 \(pid \d+\) died \(exit code -9\)"):
        run(llm, mixed_prompts(ref.model.config.vocab_size)[:2])
    shutdown(llm)


def test_sizes_the_checkpoint_cannot_split_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(tiny_llama, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        LLM(tiny_llama, device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 and the model's 6 KV heads: one must divide"):
        check_tensor_parallel_size(4, num_heads=12, num_kv_heads=6, intermediate_size=128)
    with pytest.raises(ValueError, match="does not divide the model's MLP intermediate size 100"):
        check_tensor_parallel_size(8, num_heads=8, num_kv_heads=8, intermediate_size=100)
    check_tensor_parallel_size(8, num_heads=16, num_kv_heads=2, intermediate_size=128)  # KV heads replicated 4x


def test_the_flag_reaches_the_engine_config():
    from engine.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2


def test_forward_inputs_round_trip_through_one_packed_vector():
    from engine.models.llama import AttentionMetadata
    from engine.parallel.commands import Forward

    meta = AttentionMetadata(slot_mapping=torch.tensor([5, 17, -1]),
                             query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                             seq_lens=torch.tensor([6, 18, 1], dtype=torch.int32),
                             block_tables=torch.tensor([[0, 0], [3, 1], [0, 0]], dtype=torch.int32), decode_only=True)
    ids, pos = torch.tensor([11, 12, 0]), torch.tensor([5, 17, 0])
    for on_host in (True, False):  # in the command (CPU), or broadcast after it (CUDA)
        cmd, packed = Forward.pack(ids, pos, meta, on_host)
        assert (cmd.packed is not None) == on_host and cmd.size == packed.numel()
        got_ids, got_pos, got = cmd.unpack(packed if cmd.packed is None else torch.from_numpy(cmd.packed))
        assert got_ids.tolist() == ids.tolist() and got_pos.tolist() == pos.tolist() and got.decode_only
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            want = getattr(meta, name)
            assert getattr(got, name).dtype == want.dtype and getattr(got, name).tolist() == want.tolist()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs (NCCL; one GPU cannot hold two ranks)")
def test_greedy_tp2_on_two_gpus_matches_tp1(engines):
    """The CUDA path: NCCL, inputs broadcast on the device group, rank 1 on cuda:1."""
    path = engines.path("qwen2-tied-qkv-bias")
    ref = Reference(path)
    prompts = mixed_prompts(ref.model.config.vocab_size)
    expected = [ref.generate(p) for p in prompts]
    kwargs = dict(device="cuda", num_blocks=512, async_scheduling=True)
    tp2 = LLM(path, tensor_parallel_size=2, **kwargs)
    try:
        assert tp2.engine.runner.tp.call("info")[0]["device"] == "cuda:1"
        assert run(tp2, prompts) == run(LLM(path, **kwargs), prompts) == expected
    finally:
        shutdown(tp2)
