"""The `SpeculativeDecoding` condition and each pool's `status.pools.<pool>.speculative`. Pure.

A pool asks for MTP speculative decoding with `decode.speculative` (the unified pool too). Whether it is in
force is the pods' to say: a checkpoint without MTP tensors serves without it (the apiserver cannot see the
checkpoint). Each worker pod's `/health/startup` body carries `speculative_decoding` (enabled, the reason
when not, and its draft and accepted token totals); the output monitor, which reads that body from every
running pod already, turns the reports into one condition per deployment and a summary per pool. Not being
able to speculate is not `Degraded`: the pool serves, only slower than asked; the condition says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sovereign_operator.outputhealth import OutputReport

SPECULATIVE_DECODING = "SpeculativeDecoding"
IN_FORCE = "InForce"
PARTLY_IN_FORCE = "PartlyInForce"
NO_MTP_LAYER = "NoMTPLayer"
NOT_REPORTED = "NotReported"


def requested_pool(spec: Mapping[str, Any], mode: str | None) -> tuple[str, Mapping[str, Any]] | None:
    """(the component that speculates, its `decode.speculative`) or None when nothing asks for it."""
    wanted = ((spec.get("decode") or {}).get("speculative")) if spec else None
    if wanted is None:
        return None
    return ("unified" if mode == "unified" else "decode"), wanted


def pool_summary(reports: Sequence[OutputReport], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """What `status.pools.<pool>.speculative` says for the reports of that pool's pods."""
    spec = [r.body["speculative_decoding"] for r in reports if r.body and "speculative_decoding" in r.body]
    on = [s for s in spec if s.get("enabled")]
    drafted = sum(float(s.get("draft_tokens_total") or 0) for s in on)
    accepted = sum(float(s.get("accepted_tokens_total") or 0) for s in on)
    steps = sum(float(s.get("verify_steps_total") or 0) for s in on)
    summary: dict[str, Any] = {
        "numDraftTokens": int(wanted.get("numDraftTokens", 1)),
        "podsInForce": len(on),
        "podsReporting": len(spec),
    }
    if drafted:
        # Rounded: the status is rewritten only when a figure moves by a visible amount.
        summary["acceptanceRate"] = round(accepted / drafted, 2)
    if steps:
        summary["meanAcceptLength"] = round(1 + accepted / steps, 2)
    reasons = sorted({str(s.get("reason")) for s in spec if not s.get("enabled") and s.get("reason")})
    if reasons:
        summary["reason"] = "; ".join(reasons)[:300]
    return summary


def condition_fields(component: str, summary: Mapping[str, Any]) -> tuple[str, str, str]:
    """(status, reason, message) of the SpeculativeDecoding condition for the speculating pool."""
    on, reporting = summary["podsInForce"], summary["podsReporting"]
    k = summary["numDraftTokens"]
    if reporting == 0:
        return (
            "Unknown",
            NOT_REPORTED,
            f"{component} asks for MTP speculative decoding; no pod has reported it so far",
        )
    measured = ""
    if "acceptanceRate" in summary:
        measured = f"; acceptance {summary['acceptanceRate']:.2f}"
        if "meanAcceptLength" in summary:
            measured += f", {summary['meanAcceptLength']:.2f} tokens per step"
    if on == reporting:
        return (
            "True",
            IN_FORCE,
            f"{component}: MTP with {k} draft token(s) in force on {on}/{reporting} pods{measured}",
        )
    why = summary.get("reason") or "the pods serve without it"
    if on == 0:
        return (
            "False",
            NO_MTP_LAYER,
            f"{component} asks for MTP speculative decoding but serves without it: {why}. Serve a checkpoint"
            " with its MTP tensors (model.layers.<num_hidden_layers>.*) or remove decode.speculative",
        )
    return (
        "False",
        PARTLY_IN_FORCE,
        f"{component}: in force on {on}/{reporting} pods{measured}; the others: {why}",
    )
