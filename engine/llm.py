"""Offline API: LLM(model=...).generate(prompts, SamplingParams)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.lora_errors import LoRANotEnabledError, LoRARequest
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
        # The adapters served, name -> path: --lora-modules' and those a LoRARequest loaded since.
        self.lora_adapters = self.engine.lora_paths if self.config.lora is not None else None
        self.processor = InputProcessor(self.tokenizer, self.engine.max_model_len, self.engine.vocab_size,
                                        self.lora_adapters)
        self.output_processor = OutputProcessor(self.tokenizer, OutputKind.FINAL_ONLY)
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request` (vLLM's): one adapter for every prompt, or one (or None) per prompt; an
        adapter is loaded the first time it is named (an engine made with enable_lora=True)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        if lora_request is not None:
            loras = [lora_request] * len(prompts) if isinstance(lora_request, LoRARequest) else list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError("need one lora_request per prompt")
            sampling_params = [params if lora is None else dataclasses.replace(params, lora_name=self._lora(lora))
                               for params, lora in zip(sampling_params, loras)]
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


    def _lora(self, lora: LoRARequest) -> str:
        """The adapter's name, loaded now if it is not yet."""
        if self.lora_adapters is None:
            raise LoRANotEnabledError("a lora_request needs an engine made with enable_lora=True")
        loaded = self.lora_adapters.get(lora.lora_name)
        if loaded is None:
            self.engine.add_lora(lora.lora_name, lora.lora_path)
        elif loaded != lora.lora_path:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is loaded from {loaded}, not {lora.lora_path}: "
                             "give another adapter another name")
        return lora.lora_name

    def remove_lora(self, name: str) -> None:
        """Unloads an adapter (vLLM's engine.remove_lora); it may be loaded again later."""
        if self.lora_adapters is None:
            raise LoRANotEnabledError("LoRA is not enabled on this engine (enable_lora=True)")
        self.engine.remove_lora(name)


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
