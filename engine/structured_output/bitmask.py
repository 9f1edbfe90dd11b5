"""The model runner's half: one bitmask for the batch's grammar rows, applied to the logits in one pass."""
from __future__ import annotations

import time

import torch

from engine.sampler import on_device


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, vocab_size]: token 32 * i + j allowed when bit j of word i is set."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """The plain torch version of apply_token_bitmask_inplace (what the tests compare against):
    logits[i] = -inf wherever bitmask[i] disallows, for the rows in indices; the others untouched."""
    out = logits.clone()
    rows = torch.tensor(indices, dtype=torch.long, device=logits.device)
    allowed = bitmask_to_allowed(bitmask[rows].to(logits.device), logits.shape[-1])
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out


class GrammarBitmask:
    """A host buffer of max_num_seqs bitmask rows (pinned on CUDA): each step fills the rows of
    requests with a grammar, copies them to the logits' device without waiting, and masks those
    rows in place with xgrammar's kernel (CPU or CUDA). The buffer is refilled only after the
    previous step was collected (grammar rows are never launched ahead), so the copy is done."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.host = torch.full((max_num_seqs, bitmask_words(vocab_size)), -1, dtype=torch.int32,
                               pin_memory=device.type == "cuda")
        self.num_masked_rows = 0
        self.host_seconds = 0.0  # on the host: filling rows and launching the mask (benchmarks read it)
        # xgrammar's own choice on CUDA is its Triton kernel; without Triton, plain torch ops.
        self.kernel = "auto"
        if device.type == "cuda":
            import importlib.util

            self.kernel = "triton" if importlib.util.find_spec("triton") is not None else "torch_native"

    def apply(self, logits: torch.Tensor, requests: list) -> torch.Tensor:
        """Mask logits [n, vocab] (row i samples for requests[i]) where each row's grammar says no."""
        rows = [i for i, r in enumerate(requests) if r.structured_output is not None]
        if not rows:
            return logits
        from xgrammar import apply_token_bitmask_inplace

        start = time.perf_counter()
        n = len(requests)
        host = self.host[:n]
        for i in rows:
            requests[i].structured_output.fill_bitmask(host, i)
        mask = host if self.device.type != "cuda" else host.to(self.device, non_blocking=True)
        logits = logits.float().contiguous()  # the kernels take float32 rows
        # Row indices through pinned memory too: xgrammar would copy a list from pageable memory,
        # which waits for every step queued before it.
        indices = on_device(rows, self.device, torch.int32) if len(rows) < n else None
        apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[-1]),
                                    indices=indices, backend=self.kernel)
        self.num_masked_rows += len(rows)
        self.host_seconds += time.perf_counter() - start
        return logits
