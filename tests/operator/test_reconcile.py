"""The reconciler against a fake apiserver: applies, zero writes in steady state, retries, prune."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from lightkube import codecs
from operator_fakes import FakeKube, body_for
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC, with_changes
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.gone import DeploymentGone
from sovereign_operator.observe import Problem
from sovereign_operator.reconcile import Reconciler, RetryLater, backoff_seconds, replica_overrides
from sovereign_operator.render import DeploymentRef, render

RDMA = "rdma/rdma_shared_device_a"


def _clock() -> str:
    return "2026-01-01T00:00:00Z"


def test_first_reconcile_applies_everything_then_steady_state_writes_nothing() -> None:
    kube = FakeKube(body_for(TINY_SPEC))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        applied, writes = kube.applies, len(kube.status_writes)
        assert applied == len(
            render(DeploymentRef("llm", "ns", "uid-1"), LLMDeploymentSpec.model_validate(TINY_SPEC)).children
        )
        assert writes == 1
        assert kube.body["status"]["conditions"][0] == {
            "type": "Ready",
            "status": "True",
            "reason": "AllReplicasReady",
            "message": kube.body["status"]["conditions"][0]["message"],
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "observedGeneration": 1,
        }
        # Steady state: a resume, child events and timers change nothing.
        await reconciler.reconcile(kube.body)
        for _ in range(3):
            assert await reconciler.refresh_status("ns", "llm") is False
        assert (kube.applies, len(kube.status_writes)) == (applied, writes)

    asyncio.run(scenario())


def test_spec_change_to_disaggregated_applies_and_prunes_the_unified_pool() -> None:
    kube = FakeKube(body_for(with_changes(DEEPSEEK_SPEC, mode="auto", networking__rdma__enabled="auto")))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        assert ("StatefulSet", "llm-unified") in kube.children
        assert kube.body["status"]["mode"] == "unified"
        kube.advertised = frozenset({RDMA})
        kube.body["metadata"]["generation"] = 2
        await reconciler.reconcile(kube.body)
        assert ("StatefulSet", "llm-unified") not in kube.children
        assert {("StatefulSet", "llm-prefill"), ("StatefulSet", "llm-decode")} <= set(kube.children)
        assert "StatefulSet/llm-unified" in kube.deleted
        status = kube.body["status"]
        assert status["mode"] == "disaggregated" and "unified" not in status["pools"]
        assert status["observedGeneration"] == 2

    asyncio.run(scenario())


def test_removing_the_chat_template_prunes_its_config_map() -> None:
    kube = FakeKube(body_for(with_changes(TINY_SPEC, runtime__chatTemplate="{{ messages }}")))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        assert ("ConfigMap", "llm-chat-template") in kube.children
        kube.body["spec"] = copy.deepcopy(TINY_SPEC)
        kube.body["metadata"]["generation"] = 2
        await reconciler.reconcile(kube.body)
        assert ("ConfigMap", "llm-chat-template") not in kube.children
        assert ("ConfigMap", "llm-runtime") in kube.children
        assert kube.deleted == ["ConfigMap/llm-chat-template"]

    asyncio.run(scenario())


def test_a_spec_change_that_renders_the_same_children_is_observed_in_status() -> None:
    """A new generation whose children are unchanged (here: the runtime image set to the one the
    operator uses anyway, as e2e/kind/up.sh does right after creating the object) writes nothing to
    the children but must still move status to that generation; the refresh had waited for it
    forever, so such a deployment never showed Ready."""
    kube = FakeKube(body_for(TINY_SPEC))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        assert await reconciler.sync("ns", "llm") is None  # the work queue's path: no refresh
        applied = kube.applies
        image = render(
            DeploymentRef("llm", "ns", "uid-1"), LLMDeploymentSpec.model_validate(TINY_SPEC)
        ).children
        default_image = next(
            c["spec"]["template"]["spec"]["containers"][0]["image"]
            for c in image
            if c["kind"] == "StatefulSet"
        )
        kube.body["spec"] = with_changes(TINY_SPEC, runtime__image=default_image)
        kube.body["metadata"]["generation"] = 2
        assert reconciler.wants(kube.body)
        assert await reconciler.sync("ns", "llm") is None
        assert kube.applies == applied  # nothing to write to the children
        assert not reconciler.wants(kube.body)  # generation 2 is reconciled
        assert await reconciler.refresh_status("ns", "llm") is True
        status = kube.body["status"]
        assert status["observedGeneration"] == 2
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["observedGeneration"]) == ("True", 2)

    asyncio.run(scenario())


def test_invalid_spec_is_degraded_with_an_event_and_no_retry() -> None:
    problems: list[Problem] = []
    kube = FakeKube(body_for(with_changes(TINY_SPEC, mode="sideways")))
    reconciler = Reconciler(kube, clock=_clock, report_problem=lambda body, problem: problems.append(problem))

    async def scenario() -> None:
        outcome = await reconciler.reconcile(kube.body)
        assert outcome.rendered is None and kube.applies == 0
        degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
        assert "spec.mode" in degraded["message"]
        assert [p.reason for p in problems] == ["InvalidSpec"]
        writes = len(kube.status_writes)
        await reconciler.reconcile(kube.body)
        assert len(kube.status_writes) == writes  # the same problem is not rewritten

    asyncio.run(scenario())


def test_a_chat_template_that_does_not_parse_is_degraded_before_any_pod() -> None:
    problems: list[Problem] = []
    kube = FakeKube(body_for(with_changes(TINY_SPEC, runtime__chatTemplate="{{ bos_token }}\n{% if x %}")))
    reconciler = Reconciler(kube, clock=_clock, report_problem=lambda body, problem: problems.append(problem))

    async def scenario() -> None:
        outcome = await reconciler.reconcile(kube.body)
        assert outcome.rendered is None and kube.applies == 0
        degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "InvalidSpec"
        assert degraded["message"].startswith(
            "spec.runtime.chatTemplate: the Jinja template does not parse: line 2"
        )

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("code", "retried"), [(500, True), (429, True), (409, True), (403, True), (422, False)]
)
def test_api_errors_retry_with_backoff_or_degrade(code: int, retried: bool) -> None:
    problems: list[Problem] = []
    kube = FakeKube(body_for(TINY_SPEC))
    kube.fail_apply_with = code
    reconciler = Reconciler(kube, clock=_clock, report_problem=lambda body, problem: problems.append(problem))

    async def scenario() -> None:
        if retried:
            with pytest.raises(RetryLater) as caught:
                await reconciler.reconcile(kube.body, retry=2)
            assert caught.value.delay == backoff_seconds(2)
        else:
            outcome = await reconciler.reconcile(kube.body)
            assert outcome.problem is not None and outcome.problem.reason == "ApplyRejected"
            degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
            assert degraded["reason"] == "ApplyRejected"

    asyncio.run(scenario())
    if code in (403, 422):
        assert problems, "a person must hear about RBAC gaps and rejected children"


@pytest.mark.parametrize(
    ("code", "message", "reason", "retried"),
    [
        (
            403,
            'poddisruptionbudgets "tiny-unified" is forbidden: exceeded quota: q, requested: '
            "count/poddisruptionbudgets.policy=1",
            "QuotaExceeded",
            True,
        ),
        (403, 'admission webhook "deny.example" denied the request: no', "AdmissionDenied", True),
        (403, "User cannot patch resource poddisruptionbudgets", "Forbidden", True),
        (409, 'Apply failed with 1 conflict: conflict with "kubectl"', "Conflict", True),
        (
            422,
            "PodDisruptionBudget.policy is invalid: spec.minAvailable: Invalid value",
            "ApplyRejected",
            False,
        ),
    ],
)
def test_a_child_that_cannot_be_applied_is_named_with_the_apiservers_message(
    code: int, message: str, reason: str, retried: bool
) -> None:
    problems: list[Problem] = []
    kube = FakeKube(body_for(TINY_SPEC))
    kube.fail_apply_of = ("PodDisruptionBudget", code, message)
    reconciler = Reconciler(kube, clock=_clock, report_problem=lambda body, problem: problems.append(problem))

    async def scenario() -> None:
        if retried:
            with pytest.raises(RetryLater):
                await reconciler.reconcile(kube.body)
        else:
            await reconciler.reconcile(kube.body)

    asyncio.run(scenario())
    degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == reason
    assert "PodDisruptionBudget/llm-unified" in degraded["message"] and message in degraded["message"]
    assert [p.reason for p in problems] == [reason]


def test_a_namespace_being_deleted_ends_the_deployment_without_retries_or_events() -> None:
    """Its children's deletions each put it on the queue: one refused write ends it, until its
    DELETED arrives (a new object of the same name is reconciled again)."""
    problems: list[Problem] = []
    kube = FakeKube(body_for(TINY_SPEC))
    kube.body["metadata"]["uid"] = "uid-1"
    kube.fail_apply_of = (
        "Service",
        403,
        'services "llm" is forbidden: unable to create new content in namespace ns because it is being terminated',
    )
    reconciler = Reconciler(kube, clock=_clock, report_problem=lambda body, problem: problems.append(problem))

    async def scenario() -> None:
        assert await reconciler.sync("ns", "llm") is None
        applies = kube.applies
        assert not reconciler.wants(kube.body)
        assert await reconciler.sync("ns", "llm") is None
        assert kube.applies == applies and problems == []
        reconciler.deleted("ns", "llm")
        kube.fail_apply_of = None
        kube.body["metadata"]["uid"] = "uid-2"
        assert reconciler.wants(kube.body)
        assert await reconciler.sync("ns", "llm") is None
        assert kube.applies > applies

    asyncio.run(scenario())


def test_a_transient_failure_that_persists_is_reported_and_retried_with_backoff() -> None:
    """A full Service IP range answers 500 every time: the queue's retries back off, and from the
    third attempt on status and an Event name the child and the apiserver's message."""
    problems: list[Problem] = []
    kube = FakeKube(body_for(TINY_SPEC))
    message = 'failed to allocate a serviceIP for Service "llm": range is full'
    kube.fail_apply_of = ("Service", 500, message)
    reconciler = Reconciler(kube, clock=_clock, report_problem=lambda body, problem: problems.append(problem))

    async def scenario() -> list[float | None]:
        delays = []
        for _ in range(3):
            delays.append(await reconciler.sync("ns", "llm"))
            await reconciler.refresh_status("ns", "llm")
            if len(delays) < 3:
                assert "status" not in kube.body and problems == []
        kube.fail_apply_of = None
        delays.append(await reconciler.sync("ns", "llm"))
        await reconciler.refresh_status("ns", "llm")
        return delays

    delays = asyncio.run(scenario())
    assert delays[:3] == [backoff_seconds(0), backoff_seconds(1), backoff_seconds(2)] and delays[3] is None
    assert [p.reason for p in problems] == ["ApplyFailing"]
    assert "Service/llm" in problems[0].message and message in problems[0].message
    degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"  # applied at last


def test_backoff_grows_and_is_capped() -> None:
    delays = [backoff_seconds(retry) for retry in range(10)]
    assert delays == sorted(delays) and delays[0] >= 1 and delays[-1] == 300


def test_a_stale_event_body_does_not_undo_the_autoscalers_latest_decision() -> None:
    spec = with_changes(DEEPSEEK_SPEC, decode={"autoscaling": {"minReplicas": 1, "maxReplicas": 4}})
    kube = FakeKube(body_for(spec))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        stale = copy.deepcopy(kube.body)  # what a watch event carried before the decision
        kube.body["status"]["pools"]["decode"]["autoscaler"] = {"desiredReplicas": 3}
        await reconciler.reconcile(copy.deepcopy(kube.body))
        await reconciler.reconcile(stale)
        assert kube.children[("StatefulSet", "llm-decode")]["spec"]["replicas"] == 3

    asyncio.run(scenario())


def test_autoscaler_decision_in_status_becomes_replicas() -> None:
    spec = with_changes(DEEPSEEK_SPEC, decode={"autoscaling": {"minReplicas": 1, "maxReplicas": 4}})
    kube = FakeKube(body_for(spec))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        assert kube.children[("StatefulSet", "llm-decode")]["spec"]["replicas"] == 1
        kube.body["status"]["pools"]["decode"]["autoscaler"] = {"desiredReplicas": 3}
        await reconciler.reconcile(kube.body)
        assert kube.children[("StatefulSet", "llm-decode")]["spec"]["replicas"] == 3
        assert kube.body["status"]["pools"]["decode"]["autoscaler"] == {"desiredReplicas": 3}
        assert kube.body["status"]["decodeReplicas"] == "3/3"
        assert "replicas" not in kube.body["spec"]["decode"]

    asyncio.run(scenario())
    assert replica_overrides(
        {"pools": {"prefill": {"autoscaler": {"desiredReplicas": 2}}, "decode": {}}}
    ) == {"prefill": 2}


@pytest.mark.parametrize("spec", [TINY_SPEC, DEEPSEEK_SPEC], ids=["tiny", "deepseek"])
def test_children_survive_the_lightkube_round_trip(spec: dict[str, Any]) -> None:
    rendered = render(DeploymentRef("llm", "ns", "u"), LLMDeploymentSpec.model_validate(spec))
    for child in rendered.children:
        assert codecs.from_dict(child).to_dict() == child, child["kind"]


def test_a_name_too_long_for_children_is_degraded_not_applied() -> None:
    body = body_for(TINY_SPEC)
    body["metadata"]["name"] = "n" * 41
    kube = FakeKube(body)
    outcome = asyncio.run(Reconciler(kube, clock=_clock).reconcile(kube.body))
    assert outcome.problem is not None and "metadata.name" in outcome.problem.message
    assert kube.applies == 0


def test_auto_mode_is_resolved_when_the_spec_changes_and_then_kept() -> None:
    kube = FakeKube(body_for(with_changes(DEEPSEEK_SPEC, mode="auto", networking__rdma__enabled="auto")))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        assert kube.body["status"]["mode"] == "unified"
        # RDMA devices appear (or a device plugin flaps): the running pools stay as they are.
        kube.advertised = frozenset({RDMA})
        applies = kube.applies
        await reconciler.reconcile(kube.body, force=True)
        assert kube.body["status"]["mode"] == "unified"
        assert ("StatefulSet", "llm-unified") in kube.children
        # A new spec generation resolves again.
        kube.body["metadata"]["generation"] = 2
        kube.body["spec"]["router"] = {"replicas": 2}
        await reconciler.reconcile(kube.body)
        assert kube.body["status"]["mode"] == "disaggregated"
        assert kube.applies > applies

    asyncio.run(scenario())


def test_status_conflicts_are_retried_with_a_fresh_read() -> None:
    kube = FakeKube(body_for(TINY_SPEC))
    kube.conflicts_left = 2
    asyncio.run(Reconciler(kube, clock=_clock).reconcile(kube.body))
    assert len(kube.status_writes) == 1 and kube.body["status"]["mode"] == "unified"


def test_a_burst_of_deployments_applies_at_most_the_bound_at_once() -> None:
    kubes = [FakeKube(body_for(TINY_SPEC)) for _ in range(12)]
    for i, kube in enumerate(kubes):
        kube.body["metadata"].update(name=f"m{i}", uid=f"uid-{i}")
    in_flight, peak = 0, 0
    shared = kubes[0]
    original_apply = shared.apply

    async def slow_apply(child: dict) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1
        await original_apply(child)

    bodies = {k.body["metadata"]["name"]: k.body for k in kubes}

    async def get_deployment(namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(bodies[name])  # each its own object (uid): none is mistaken for gone

    shared.apply = slow_apply  # type: ignore[method-assign]
    shared.get_deployment = get_deployment  # type: ignore[method-assign]
    reconciler = Reconciler(shared, clock=_clock, max_concurrent_applies=3)

    async def scenario() -> None:
        await asyncio.gather(*(reconciler.reconcile(k.body) for k in kubes))

    asyncio.run(scenario())
    assert peak == 3


def test_a_retry_after_a_partial_failure_sends_only_what_was_not_applied() -> None:
    kube = FakeKube(body_for(TINY_SPEC))
    kube.fail_apply_of = ("PodDisruptionBudget", 500, "etcdserver: request timed out")
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        with pytest.raises(RetryLater):
            await reconciler.reconcile(kube.body)
        before = kube.applies
        kube.fail_apply_of = None
        await reconciler.reconcile(kube.body, retry=1)
        resent = kube.applies - before
        assert 0 < resent < len(kube.children), f"resent {resent} of {len(kube.children)} children"
        # A forced reconcile (a child was deleted) sends every child again.
        before = kube.applies
        await reconciler.reconcile(kube.body, force=True)
        assert kube.applies - before == len(kube.children)

    asyncio.run(scenario())


def test_refreshes_queued_behind_one_another_coalesce() -> None:
    kube = FakeKube(body_for(TINY_SPEC))
    reconciler = Reconciler(kube, clock=_clock)
    reads = 0
    original = kube.observe

    async def counting_observe(namespace: str, instance: str):  # type: ignore[no-untyped-def]
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.01)
        return await original(namespace, instance)

    kube.observe = counting_observe  # type: ignore[method-assign]
    meta = kube.body["metadata"]

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        start = reads
        # One refresh runs, one waits, the other 18 find it waiting.
        await asyncio.gather(*(reconciler.refresh_status(meta["namespace"], meta["name"]) for _ in range(20)))
        assert reads - start == 2

    asyncio.run(scenario())


def test_a_deployment_gone_from_the_apiserver_is_not_applied_and_leaves_no_memory() -> None:
    """A body kopf still serves for an object that is gone (its namespace deleted): nothing is written
    into a namespace that does not exist, and the reconciler forgets it."""
    kube = FakeKube(body_for(TINY_SPEC))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        stale, applied = copy.deepcopy(kube.body), kube.applies
        assert reconciler.outcomes and reconciler._applied
        kube.get_deployment = _absent  # type: ignore[method-assign]
        with pytest.raises(DeploymentGone):
            await reconciler.reconcile(stale)
        assert kube.applies == applied
        assert not reconciler.outcomes and not reconciler._applied and not reconciler._locks
        # Deleted and created again under the same name: the old body is gone, the new one is served.
        renewed = copy.deepcopy(stale)
        renewed["metadata"]["uid"] = "uid-2"
        kube.get_deployment = lambda namespace, name: _present(renewed)  # type: ignore[method-assign,assignment]
        with pytest.raises(DeploymentGone):
            await reconciler.reconcile(stale)
        await reconciler.reconcile(renewed)
        assert kube.applies > applied

    asyncio.run(scenario())


async def _absent(namespace: str, name: str) -> None:
    return None


async def _present(body: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(body)
