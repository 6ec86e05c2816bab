"""The shared Kubernetes vocabulary: one condition rule for every writer, RFC 3339 both ways, and
the operator's own Events (posted outside kopf, a failed write only logged)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from operator_specs import TINY_SPEC
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.api.status import LLMDeploymentStatus
from sovereign_operator.events import EventPoster
from sovereign_operator.observe import Observed, compute_status, status_patch
from sovereign_operator.render import ClusterFacts, DeploymentRef, render
from sovereign_operator.vocabulary import (
    condition,
    conditions_patch,
    parse_rfc3339,
    rfc3339,
    with_condition,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def test_the_transition_time_moves_only_when_the_status_flips() -> None:
    first = condition("OutputHealthy", "True", "Fine", "ok", T0, observed_generation=2)
    assert first == {
        "type": "OutputHealthy",
        "status": "True",
        "reason": "Fine",
        "message": "ok",
        "lastTransitionTime": T0,
        "observedGeneration": 2,
    }
    same = condition("OutputHealthy", "True", "StillFine", "still ok", T1, first)
    assert same["lastTransitionTime"] == T0 and same["reason"] == "StillFine"
    flipped = condition("OutputHealthy", "False", "Garbled", "bad", T1, same)
    assert flipped["lastTransitionTime"] == T1


def test_a_writer_touches_only_its_own_condition() -> None:
    ready = condition("Ready", "True", "AllReplicasReady", "", T0)
    mine = condition("OutputHealthy", "True", "Fine", "", T0)
    status = {"conditions": [ready, mine]}
    assert (
        conditions_patch(status, "OutputHealthy", condition("OutputHealthy", "True", "Fine", "", T1)) is None
    )
    worse = condition("OutputHealthy", "False", "Garbled", "bad", T1, mine)
    assert conditions_patch(status, "OutputHealthy", worse) == {"conditions": [ready, worse]}
    assert with_condition(status["conditions"], "OutputHealthy", None) == [ready]


def test_a_new_condition_type_survives_the_reconcilers_status_writes() -> None:
    # Adding a condition is one constant: the reconciler keeps every type it does not own.
    ref = DeploymentRef(name="llm", namespace="ns", uid="u", generation=1)
    rendered = render(ref, LLMDeploymentSpec.model_validate(TINY_SPEC), ClusterFacts())
    other = condition("OutputHealthy", "False", "Garbled", "decode pod llm-unified-0 repeats itself", T0)
    current: dict[str, Any] = {"conditions": [other]}
    desired = compute_status(1, rendered, Observed(), LLMDeploymentStatus.model_validate(current), T1)
    patch = status_patch(current, desired)
    assert patch is not None and other in patch["conditions"]
    assert [c["type"] for c in patch["conditions"]] == ["Ready", "Progressing", "Degraded", "OutputHealthy"]


def test_rfc3339_round_trips_whole_seconds() -> None:
    assert rfc3339(1_767_225_600.7) == T0
    assert parse_rfc3339(T0) == 1_767_225_600.0 and parse_rfc3339(None) is None


def test_events_are_written_in_order_and_a_failed_write_is_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    written: list[dict[str, Any]] = []

    async def create(event: dict[str, Any]) -> None:
        if event["reason"] == "Refused":
            raise RuntimeError("apiserver said no")
        written.append(event)

    body = {"metadata": {"name": "llm", "namespace": "ns", "uid": "u1"}}

    async def scenario() -> None:
        poster = EventPoster(create, clock=lambda: T0)
        poster.start()
        poster.post(body, "Warning", "Refused", "first")
        poster.post(body, "Normal", "ScaledUp", "x" * 5000)
        await poster.flush()
        await poster.close()

    with caplog.at_level(logging.WARNING, logger="sovereign_operator.events"):
        asyncio.run(scenario())
    [event] = written
    assert event["reason"] == "ScaledUp" and len(event["message"]) == 1000
    assert event["involvedObject"] == {
        "apiVersion": "sovereign.ai/v1alpha1",
        "kind": "LLMDeployment",
        "name": "llm",
        "namespace": "ns",
        "uid": "u1",
    }
    assert event["metadata"] == {"generateName": "llm.", "namespace": "ns"} and event["firstTimestamp"] == T0
    assert "Refused" in caplog.text and "apiserver said no" in caplog.text
