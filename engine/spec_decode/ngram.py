"""N-gram prompt lookup: the longest recent suffix (length in [min, max]) seen earlier in the prompt
or output proposes the tokens that followed it there (vLLM's method, without a model)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.request import Request
from engine.spec_decode.proposer import Proposer


def ngram_lookup(tokens, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the longest suffix of
    `tokens` of length in [min_n, max_n]; [] if none occurred. Copying may run past the end of
    `tokens` into the proposal itself, so a cycle shorter than k still proposes k tokens."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that end before the last token: starts 0 .. length - n - 1.
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            out: list[int] = []
            for i in range(k):
                j = start + i
                out.append(int(arr[j]) if j < length else out[j - length])
            return out
    return []


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, max_model_len: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        super().__init__(num_speculative_tokens, max_model_len)
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose_tokens(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [ngram_lookup(r.all_token_ids, k, self.min_n, self.max_n) for r, k in zip(requests, ks)]
