"""Offline API: LLM(model=...).generate(prompts, SamplingParams)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from engine.config import EngineConfig, lora_names
from engine.engine_core import EngineCore
from engine.outputs import OutputKind, OutputProcessor, RequestOutput
from engine.processor import InputProcessor, load_tokenizer
from engine.request import Request, SamplingParams, check_priority


class LLM:
    """The shape of vLLM's offline API. `model` is a checkpoint directory or "tiny"."""

    def __init__(self, model: str = "tiny", tokenizer: str | None = None,
                 show_progress: bool = False, **engine_kwargs) -> None:
        if model == "tiny":
            from engine.tiny import default_tiny_model
            model = default_tiny_model()
        self.config = EngineConfig.create(model=model, **engine_kwargs)
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.engine = EngineCore(self.config, show_progress)
        self.processor = InputProcessor(self.tokenizer, self.engine.max_model_len, self.engine.vocab_size,
                                        lora_names(self.config))
        self.output_processor = OutputProcessor(self.tokenizer, OutputKind.FINAL_ONLY)
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError("need one priority per prompt")
            for p in priority:
                check_priority(p, self.config.scheduler.policy)
        # Validate everything before anything is queued: a bad prompt fails the call cleanly.
        prepared = []
        for prompt, params in zip(prompts, sampling_params):
            ids = self.processor.to_token_ids(prompt)
            self.processor.validate(ids, params)
            prepared.append((prompt if isinstance(prompt, str) else None, ids, params))
        order = []
        for i, (text, ids, params) in enumerate(prepared):
            rid = str(next(self._ids))
            order.append((rid, params.n))
            for sub, sample in samples(rid, params):
                self.output_processor.add(sub, text, ids, sample)
                self.engine.add_request(Request(sub, ids, sample, eos_token_id=self.processor.eos_token_id,
                                                priority=priority[i] if priority else 0))
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outputs, stopped = self.output_processor.process(self.engine.step())
            if stopped:
                self.engine.stop_requests(stopped)
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] if n == 1 else merged(rid, [final[sub] for sub, _ in samples(rid, params)])
                for (rid, n), (_, _, params) in zip(order, prepared)]


def samples(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """n > 1: one engine request per sample, a seeded one with seed + i (vLLM's rule), so the
    samples differ and the same call gives the same ones again."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{request_id}-{i}", dataclasses.replace(params, n=1, seed=None if params.seed is None
                                                      else params.seed + i)) for i in range(params.n)]


def merged(request_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """The samples of one prompt as one RequestOutput, outputs indexed 0..n-1."""
    first = outputs[0]
    return dataclasses.replace(first, request_id=request_id, outputs=[
        dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outputs)])
