"""Pre-flight pair validation: which prefill x decode pairs can move KV between them, decided from the
pairing descriptors the engines report in GetLoad, before any request waits on a pair."""
from __future__ import annotations

import logging

from services.api.pdserve.v1 import pdserve_pb2 as pb

logger = logging.getLogger(__name__)
MAX_REASONS_SHOWN = 4  # pairs named in one error message


def valid_sharding(tp_size: int, total_kv_heads: int) -> bool:
    """Each rank holds total/tp heads (tp divides them) or one head replicated over tp/total ranks
    (tp a multiple of them), as vLLM shards KV heads."""
    return tp_size >= 1 and total_kv_heads >= 1 and (total_kv_heads % tp_size == 0 or tp_size % total_kv_heads == 0)


def pair_incompatibility(prefill: pb.PairingDescriptor, decode: pb.PairingDescriptor) -> str | None:
    """The one rule: why KV computed by `prefill` cannot feed `decode` (every difference, "; "
    separated), or None when they pair. Each side already checked its own sharding at start; a TP
    pair is refused only when one side's ranks cannot map onto the heads."""
    reasons = []
    if prefill.model_fingerprint != decode.model_fingerprint:
        reasons.append(f"model {prefill.model_name or '?'} ({prefill.model_fingerprint}) vs "
                       f"{decode.model_name or '?'} ({decode.model_fingerprint})")
    elif prefill.weights_fingerprint and decode.weights_fingerprint and \
            prefill.weights_fingerprint != decode.weights_fingerprint:
        reasons.append(f"model weights of {prefill.model_name or '?'} ({prefill.weights_fingerprint}) vs "
                       f"{decode.model_name or '?'} ({decode.weights_fingerprint}): the same architecture "
                       f"and tokenizer, another checkpoint")
    if prefill.kv_block_size != decode.kv_block_size:
        reasons.append(f"KV block size {prefill.kv_block_size} vs {decode.kv_block_size}")
    if prefill.kv_dtype != decode.kv_dtype:
        reasons.append(f"KV dtype {prefill.kv_dtype} vs {decode.kv_dtype}")
    if prefill.total_kv_heads != decode.total_kv_heads:
        reasons.append(f"total KV heads {prefill.total_kv_heads} vs {decode.total_kv_heads}")
    if not reasons and prefill.kv_layout_fingerprint != decode.kv_layout_fingerprint:
        # Same block size, dtype and heads: the layers or head_dim differ.
        reasons.append(f"KV layout {prefill.kv_layout_fingerprint} vs {decode.kv_layout_fingerprint}")
    if prefill.kv_transport != decode.kv_transport:
        reasons.append(f"KV transport {prefill.kv_transport or 'none'} vs {decode.kv_transport or 'none'}")
    if prefill.total_kv_heads == decode.total_kv_heads:
        for side, d in (("prefill", prefill), ("decode", decode)):
            if not valid_sharding(d.tensor_parallel_size, d.total_kv_heads):
                reasons.append(f"{side} tensor-parallel size {d.tensor_parallel_size} cannot shard "
                               f"{d.total_kv_heads} KV heads")
    return "; ".join(reasons) or None


class PairTable:
    """The verdict on every prefill x decode pair whose two descriptors are known, recomputed when
    one changes. A pair is logged once (WARNING) when it turns incompatible, counted in
    pdserve:router_incompatible_pairs, and listed by /readyz; it is never chosen for a request."""

    def __init__(self, metrics) -> None:
        self._metrics = metrics
        self._verdicts: dict[tuple[str, str], str | None] = {}  # (prefill, decode) -> reason or None
        # The last verdict logged per pair, kept while an instance is between reports (restarting),
        # so that one coming back unchanged is not logged again.
        self._logged: dict[tuple[str, str], str | None] = {}
        self._unchecked_logged: set[str] = set()

    def refresh(self, prefills: list, decodes: list) -> None:
        """`prefills`/`decodes`: the pool's instances; one not `described` yet is not paired."""
        for inst in prefills + decodes:
            if inst.described and not inst.load.HasField("pairing") and inst.address not in self._unchecked_logged:
                self._unchecked_logged.add(inst.address)
                logger.warning("%s instance %s reports no pairing descriptor (an engine older than the "
                               "router?): it is paired unchecked", inst.role, inst.address)
        verdicts = {}
        for p in (i for i in prefills if i.described):
            for d in (i for i in decodes if i.described):
                reason = (pair_incompatibility(p.load.pairing, d.load.pairing)
                          if p.load.HasField("pairing") and d.load.HasField("pairing") else None)
                key = (p.address, d.address)
                if reason is not None and self._logged.get(key) != reason:
                    logger.warning("prefill %s and decode %s cannot pair: %s", p.address, d.address, reason)
                elif reason is None and self._logged.get(key):
                    logger.info("prefill %s and decode %s can pair now", p.address, d.address)
                verdicts[key] = self._logged[key] = reason
        self._verdicts = verdicts
        present = {(p.address, d.address) for p in prefills for d in decodes}
        self._logged = {key: r for key, r in self._logged.items() if key in present}
        self._unchecked_logged &= {i.address for i in prefills + decodes}
        self._metrics.incompatible_pairs.set(sum(r is not None for r in verdicts.values()))

    def can_pair(self, prefill, decode) -> bool:
        key = (prefill.address, decode.address)
        return key in self._verdicts and self._verdicts[key] is None

    def incompatible(self) -> list[dict]:
        return [{"prefill": p, "decode": d, "reason": r} for (p, d), r in self._verdicts.items() if r is not None]

    def why_unpaired(self, prefills: list, decodes: list) -> str:
        """Why none of these prefills can pair with any of these decodes, for a 503."""
        lines = [f"prefill {p.address} and decode {d.address} cannot pair: "
                 f"{self._verdicts.get((p.address, d.address)) or 'not described yet (no load report)'}"
                 for p in prefills for d in decodes]
        shown = "; ".join(lines[:MAX_REASONS_SHOWN])
        if len(lines) > MAX_REASONS_SHOWN:
            shown += f"; and {len(lines) - MAX_REASONS_SHOWN} more pairs"
        return f"no healthy prefill instance can pair with a healthy decode instance ({shown})"
