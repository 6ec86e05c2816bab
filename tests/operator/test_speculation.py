"""The SpeculativeDecoding condition and the pool's speculation summary, from the pods' reports."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from operator_fakes import merge_patch
from sovereign_operator.outputhealth import OutputReport
from sovereign_operator.speculation import (
    IN_FORCE,
    NO_MTP_LAYER,
    NOT_REPORTED,
    PARTLY_IN_FORCE,
    SPECULATIVE_DECODING,
    condition_fields,
    pool_summary,
    requested_pool,
)
from sovereign_operator.vocabulary import find_condition
from test_outputmonitor import FakeKube, _monitor, _pod, _startup, pods_serving

ON = {"enabled": True, "algorithm": "mtp", "num_draft_tokens": 2, "verify_steps_total": 100,
      "draft_tokens_total": 200, "accepted_tokens_total": 150}  # fmt: skip
OFF = {"enabled": False, "algorithm": "mtp", "num_draft_tokens": 2,
       "reason": "config.json declares num_nextn_predict_layers 1 but the checkpoint ships no MTP tensors"}  # fmt: skip


def _report(pod: str, spec: dict[str, Any] | None) -> OutputReport:
    body: dict[str, Any] = {"phase": "ready"}
    if spec is not None:
        body["speculative_decoding"] = spec
    return OutputReport(pod, "decode", body=body)


def test_requested_pool_follows_the_mode() -> None:
    spec = {"decode": {"speculative": {"numDraftTokens": 2}}}
    assert requested_pool(spec, "unified") == ("unified", {"numDraftTokens": 2})
    assert requested_pool(spec, "disaggregated") == ("decode", {"numDraftTokens": 2})
    assert requested_pool({"decode": {"replicas": 1}}, "unified") is None


def test_in_force_pools_report_the_measured_acceptance() -> None:
    other = dict(ON, verify_steps_total=100, draft_tokens_total=200, accepted_tokens_total=50)
    summary = pool_summary([_report("d-0", ON), _report("d-1", other)], {"numDraftTokens": 2})
    assert summary == {"numDraftTokens": 2, "podsInForce": 2, "podsReporting": 2, "acceptanceRate": 0.5,
                       "meanAcceptLength": 2.0}  # fmt: skip
    status, reason, message = condition_fields("decode", summary)
    assert (status, reason) == ("True", IN_FORCE)
    assert "2/2 pods" in message and "acceptance 0.50" in message and "2.00 tokens per step" in message


def test_a_checkpoint_without_mtp_tensors_is_a_false_condition_naming_why() -> None:
    summary = pool_summary([_report("d-0", OFF)], {"numDraftTokens": 2})
    assert summary["podsInForce"] == 0 and "ships no MTP tensors" in summary["reason"]
    status, reason, message = condition_fields("decode", summary)
    assert (status, reason) == ("False", NO_MTP_LAYER) and "ships no MTP tensors" in message
    mixed = pool_summary([_report("d-0", OFF), _report("d-1", ON)], {"numDraftTokens": 2})
    assert condition_fields("decode", mixed)[:2] == ("False", PARTLY_IN_FORCE)
    assert condition_fields("decode", pool_summary([_report("d-0", None)], {}))[:2] == (
        "Unknown",
        NOT_REPORTED,
    )


class MergingKube(FakeKube):
    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None:
        self.writes.append(copy.deepcopy(patch))
        merge_patch(self.body.setdefault("status", {}), copy.deepcopy(patch))


def test_the_monitor_writes_the_condition_and_summary_once_and_clears_them() -> None:
    asyncio.run(_monitor_round_trip())


async def _monitor_round_trip() -> None:
    body = {
        "metadata": {"name": "v3", "namespace": "ns", "generation": 2, "resourceVersion": "1"},
        "spec": {"mode": "disaggregated", "decode": {"replicas": 1, "speculative": {"numDraftTokens": 2}}},
        "status": {"mode": "disaggregated", "pools": {"decode": {"replicas": 1}}},
    }
    kube = MergingKube(body, [_pod("v3-decode-0", "decode")])
    answers = {"v3-decode-0": {**_startup(True), "speculative_decoding": ON}}
    async with pods_serving(answers) as base:
        monitor, session = await _monitor(kube, base, [], [1000.0])
        try:
            await monitor.tick("ns", "v3", kube.body)
            status = kube.body["status"]
            cond = find_condition(status["conditions"], SPECULATIVE_DECODING)
            assert cond is not None and cond["status"] == "True" and cond["reason"] == IN_FORCE
            assert status["pools"]["decode"]["speculative"]["acceptanceRate"] == 0.75
            assert status["pools"]["decode"]["replicas"] == 1  # the reconciler's part is left alone
            writes = len(kube.writes)
            await monitor.tick("ns", "v3", kube.body)  # steady: nothing to write
            assert len(kube.writes) == writes
            del kube.body["spec"]["decode"]["speculative"]  # no longer asked for: both go
            await monitor.tick("ns", "v3", kube.body)
            status = kube.body["status"]
            assert find_condition(status["conditions"], SPECULATIVE_DECODING) is None
            assert "speculative" not in status["pools"]["decode"]
        finally:
            await session.close()
