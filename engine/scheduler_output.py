"""What crosses the scheduler's boundary each step: its output to the model runner, the runner's
output back, and what the engine core emits per request (small dataclasses, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import Request

if TYPE_CHECKING:
    from engine.kv_connector import KVConnectorMetadata, KVConnectorOutput


@dataclass
class SchedulerOutput:
    # Parallel lists: request i computes num_scheduled_tokens[i] tokens this step, and its block
    # table grows by new_block_ids[i] (every block allocated for it since it was last scheduled;
    # all of its blocks the first time, or after a preemption).
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # since the last step
    kv_connector_metadata: "KVConnectorMetadata | None" = None
    # Speculative decoding: request id -> the proposals it verifies this step (they follow its
    # known tokens; num_scheduled_tokens counts them); and request id -> how many of its blocks it
    # still holds, where rejected proposals' blocks were released since it was last scheduled.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_kept_blocks: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass
class ModelOutput:
    """One sampled token per scheduled request that caught up with its known tokens, in order."""
    sampled_token_ids: list[int]
    # Per sampled token: (logprob of the sampled token, [(token id, logprob), ...top-n]) or None.
    logprobs: list | None = None
    # request id -> prompt-token logprob entries computed this step (same entry shape).
    prompt_logprobs: dict[str, list] | None = None
    kv_connector_output: "KVConnectorOutput | None" = None
    # With speculative decoding, in place of sampled_token_ids: per sampled row, every token it
    # produced (its accepted proposals, then the target's own token), and logprobs then holds a
    # list of entries (or None) per row.
    sampled_token_runs: list[list[int]] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list | None = None
    num_cached_tokens: int = 0
    # Prefill-only requests finish without a finish_reason when another engine decodes the
    # rest; kv_handle is then what it pulls the prompt's blocks with.
    finished: bool = False
    kv_handle: bytes | None = None
    prompt_logprobs: list | None = None  # with the first token, when asked for
    queue_time: float | None = None  # with the first token: seconds from arrival to first scheduled
