"""--device: auto picks the first visible GPU, else the CPU; sampling runs on the engine's device."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.device import resolve_device
from engine.request import InvalidRequestError

SAMPLING = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=2, max_tokens=8, logprobs=2),
            SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=(3, 976))]


def test_auto_is_the_first_gpu_else_the_cpu():
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cpu:0", ""])
def test_bad_device_names_are_refused(spec):
    with pytest.raises(ValueError, match="device must be"):
        resolve_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_says_so(tiny_llama):
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        LLM(tiny_llama, device="cuda")


def test_every_sampling_path_runs_on_the_device_and_seeds_repeat(tiny_llama, device):
    prompts = [[5, 6, 7], [40, 41, 42, 43], [100, 101]]
    runs = [LLM(tiny_llama, device=device).generate(prompts, SAMPLING) for _ in range(2)]
    first, second = ([o.outputs[0].token_ids for o in run] for run in runs)
    assert first == second  # seeded and greedy requests repeat run to run
    assert all(len(t) == 8 for t in first[:2]) and len(first[2]) >= 4
    assert 3 not in first[2][:3]  # min_tokens: no stop token before the fourth
    assert all(len(e) >= 2 for e in runs[0][1].outputs[0].logprobs)
    # An out-of-vocabulary stop id is refused before it reaches the sampler (as vLLM does).
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        LLM(tiny_llama, device=device).generate([[5, 6]], SamplingParams(min_tokens=2, stop_token_ids=(10 ** 6,)))
