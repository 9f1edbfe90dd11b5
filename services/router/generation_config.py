"""A model's own sampling defaults (vLLM's --generation-config): the temperature, top-p, top-k,
min-p, penalties and max_new_tokens its `generation_config.json` sets apply to the HTTP requests
that do not set them, as vLLM applies them (a request's own values win, then the model's, then
OpenAI's). Qwen3's file, for one, asks for temperature 0.6, top-p 0.95 and top-k 20: served
without them, the same request samples differently here than on vLLM.

Read as JSON (the router imports neither torch nor transformers): `auto` reads the model
folder's `generation_config.json` (or, without one, the same keys in its `config.json`, as
transformers' GenerationConfig.from_model_config does); `vllm` uses none (vLLM's neutral
defaults); a folder reads that folder's file. `--override-generation-config` (JSON) goes on top.
"""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

# The keys vLLM takes from a generation config (max_new_tokens is its max_tokens).
SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                 "min_p", "max_new_tokens")
SOURCES = ("auto", "vllm")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def sampling_defaults(model_path: str, source: str = "auto", override: dict | None = None) -> dict:
    """SamplingParams keyword defaults (max_tokens for max_new_tokens), checked: a value the
    engines would refuse is a start-up error naming where it came from."""
    if source == "vllm":
        config, where = {}, "nothing"
    else:
        folder = model_path if source == "auto" else source
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            config, where = _read(path), path
        elif source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
        else:
            fallback = os.path.join(folder, "config.json")
            config = _read(fallback) if os.path.isfile(fallback) else {}
            config, where = config.get("text_config", config), fallback
    if override:
        if not isinstance(override, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        unknown = sorted(set(override) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"--override-generation-config: unknown keys {unknown}; "
                             f"known: {', '.join(SAMPLING_KEYS)}")
        config, where = {**config, **override}, f"{where} and --override-generation-config"
    defaults = {("max_tokens" if k == "max_new_tokens" else k): config[k] for k in SAMPLING_KEYS
                if config.get(k) is not None}
    _check(defaults, where)
    if defaults:
        logger.warning("default sampling parameters come from %s: %s (a request's own values win; "
                       "--generation-config vllm for none)", where, defaults)
    return defaults


def _check(defaults: dict, where: str) -> None:
    from engine.request import InvalidRequestError, SamplingParams

    for key, value in defaults.items():
        kinds = int if key in ("top_k", "max_tokens") else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ValueError(f"sampling defaults from {where}: {key} must be "
                             f"{'an integer' if kinds is int else 'a number'}, got {value!r}")
    try:
        SamplingParams(**{"max_tokens": 16, **defaults})
    except InvalidRequestError as e:
        raise ValueError(f"sampling defaults from {where}: {e}") from None
