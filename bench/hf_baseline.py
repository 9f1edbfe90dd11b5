"""The transformers baseline of `make bench-engine`: `generate` in static batches (a worker process)."""
from __future__ import annotations

import json
import sys

from engine_bench import load_spec, pin_cpus, timed_passes, write_result


def generate_static_batches(model, workload: list[dict], batch_size: int, pad_id: int,
                            max_new_tokens=None, device: str = "cpu") -> list[list[int]]:
    """Left padding, greedy; each batch runs to its longest request, and each request keeps
    only its own tokens. min_new_tokens = max_new_tokens suppresses EOS as vLLM's min_tokens does."""
    import torch

    outputs: list[list[int]] = []
    for start in range(0, len(workload), batch_size):
        batch = workload[start:start + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids = r["prompt_token_ids"]
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        new = max_new_tokens or max(r["output_len"] for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id)
        for i, r in enumerate(batch):
            outputs.append(out[i, width:width + r["output_len"]].tolist())
    return outputs


def main() -> None:
    spec = load_spec(sys.argv[1:])
    pin_cpus(spec["cpus"], spec["threads"])
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos; lengths come from min/max_new_tokens
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with open(spec["workload"]) as f:
        workload = json.load(f)
    b = spec["batch_size"]

    def warmup():  # a short generate: static batching has nothing to compile or size up
        generate_static_batches(model, workload[:b], b, pad_id, max_new_tokens=4)

    walls, outputs = timed_passes(lambda: generate_static_batches(model, workload, b, pad_id),
                                  spec["passes"], warmup)
    write_result(spec, {"pass_wall_s": walls, "outputs": outputs, "version": transformers.__version__})


if __name__ == "__main__":
    main()
