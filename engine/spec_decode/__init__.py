"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the rejection sampler
that verifies their proposals in one target forward while keeping the target's distribution."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from engine.scheduler import Scheduler
    from engine.spec_decode.config import SpeculativeConfig
    from engine.spec_decode.proposer import Proposer


def make_proposer(config: "SpeculativeConfig | None", max_model_len: int, runner,
                  block_ids_of: Callable[[str], list[int]]) -> "Proposer | None":
    """The configured method's proposer (None: speculation off). A draft model runs on the target
    runner's device, in a KV cache of its own indexed by the target's block ids."""
    if config is None:
        return None
    if config.method == "ngram":
        from engine.spec_decode.ngram import NgramProposer
        return NgramProposer(config.num_speculative_tokens, max_model_len, config.prompt_lookup_min,
                             config.prompt_lookup_max)
    from engine.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(config, max_model_len, runner, block_ids_of)


def spec_decode_stats(scheduler: "Scheduler", proposer: "Proposer | None") -> dict:
    """Counters as vLLM names them (spec_decode_num_drafts, ...); empty with speculation off."""
    if proposer is None:
        return {}
    s = scheduler
    stats = {"spec_decode_num_drafts": s.spec_num_drafts, "spec_decode_num_draft_tokens": s.spec_num_draft_tokens,
             "spec_decode_num_accepted_tokens": s.spec_num_accepted_tokens,
             "spec_decode_num_backed_off": proposer.num_backed_off,
             # Accepted proposals per proposal, and tokens per verifying row (accepted + the target's).
             "spec_decode_acceptance_rate": s.spec_num_accepted_tokens / max(1, s.spec_num_draft_tokens),
             "spec_decode_mean_accepted_length": 1 + s.spec_num_accepted_tokens / max(1, s.spec_num_drafts)}
    for pos, n in enumerate(s.spec_accepted_per_pos):
        stats[f"spec_decode_num_accepted_tokens_per_pos_{pos}"] = n
    return stats
