"""Pod failures as Degraded reasons, startup-probe restarts naming the phase, observed startup time.

Pods are written the way a kubelet reports them (containerStatuses with state, lastState, started,
ready, containerID; the pod's own probes in its spec), including the states it alternates between
while it retries, which must not flip the condition.
"""

from __future__ import annotations

import copy
from typing import Any

from operator_specs import TINY_SPEC, with_changes
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.observe import Observed, compute_status, status_patch
from sovereign_operator.podstatus import (
    BudgetFacts,
    LifeMemory,
    StartupReport,
    observed_startup_seconds,
    pod_problems,
    readiness_failing,
)
from sovereign_operator.render import DeploymentRef, render
from sovereign_operator.vocabulary import parse_rfc3339

T0 = "2026-03-01T10:00:00Z"
T0_S = parse_rfc3339(T0) or 0.0


def at(seconds: float) -> str:
    from sovereign_operator.vocabulary import rfc3339

    return rfc3339(T0_S + seconds)


IMAGE = "ghcr.io/sovereign-ai/sovereign-runtime:0.1.0"


def pod(
    name: str = "llm-unified-0",
    component: str = "unified",
    *,
    state: dict[str, Any] | None = None,
    last: dict[str, Any] | None = None,
    started: bool | None = None,
    ready: bool = False,
    ready_since: str = T0,
    container_id: str = "containerd://life-2",
    failure_threshold: int = 6,
    memory: str | None = "4Gi",
    deleting: bool = False,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": "runtime",
        "image": IMAGE,
        "ready": ready,
        "restartCount": 1 if last else 0,
        "state": state if state is not None else {"running": {"startedAt": T0}},
        "lastState": {"terminated": last} if last else {},
    }
    if started is not None:
        status["started"] = started
    if "running" in status["state"]:
        status["containerID"] = container_id
    limits = {"memory": memory} if memory else {}
    meta: dict[str, Any] = {
        "name": name,
        "uid": f"uid-{name}",
        "labels": {"app.kubernetes.io/component": component, "app.kubernetes.io/instance": "llm"},
    }
    if deleting:
        meta["deletionTimestamp"] = at(5)
    return {
        "metadata": meta,
        "spec": {
            "nodeName": "node-a",
            "terminationGracePeriodSeconds": 165,
            "containers": [
                {
                    "name": "runtime",
                    "image": IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "resources": {"limits": limits},
                    "startupProbe": {
                        "httpGet": {"path": "/health/startup", "port": "http"},
                        "periodSeconds": 10,
                        "failureThreshold": failure_threshold,
                    },
                    "readinessProbe": {"httpGet": {"path": "/health/ready", "port": "http"}},
                }
            ],
        },
        "status": {
            "phase": "Running" if "running" in status["state"] else "Pending",
            "podIP": "10.0.0.7",
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": ready_since}
            ],
            "containerStatuses": [status],
        },
    }


def ended(
    reason: str, code: int, ran_s: float, *, life: str = "containerd://life-1", message: str = ""
) -> dict[str, Any]:
    out = {
        "reason": reason,
        "exitCode": code,
        "startedAt": at(-ran_s - 5),
        "finishedAt": at(-5),
        "containerID": life,
    }
    if message:
        out["message"] = message
    return out


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"waiting": {"reason": reason, "message": message}}


def one(pods: list[dict[str, Any]], **kw: Any) -> tuple[str, str]:
    problems = pod_problems(pods, **kw)
    assert len(problems) == 1, problems
    return problems[0].reason, problems[0].message


# ---- images ------------------------------------------------------------------------------------


def test_a_missing_image_is_one_reason_and_one_message_while_the_kubelet_retries() -> None:
    pull = pod(state=waiting("ErrImagePull", 'failed to pull "x": not found'))
    backoff = pod(state=waiting("ImagePullBackOff", 'Back-off pulling image "x"'))
    assert one([pull]) == one([backoff])  # no status write per retry
    reason, message = one([pull])
    assert reason == "ImagePullFailed"
    assert IMAGE in message and "node-a" in message and "IfNotPresent" in message
    assert "without a registry" in message and "imported" in message and "spec.runtime.image" in message


def test_an_image_that_may_never_be_pulled_says_import_it() -> None:
    reason, message = one([pod(state=waiting("ErrImageNeverPull", "Container image is not present"))])
    assert reason == "ImagePullFailed"
    assert "imagePullPolicy is Never" in message and "ctr -n k8s.io images import" in message


def test_configuration_errors_keep_the_kubelets_reason_and_message() -> None:
    message = 'configmap "llm-runtime" not found'
    reason, text = one([pod(state=waiting("CreateContainerConfigError", message))])
    assert reason == "CreateContainerConfigError" and message in text


# ---- OOM ---------------------------------------------------------------------------------------


def test_an_oom_kill_names_the_limit_and_the_field_to_raise() -> None:
    crashed = pod(state=waiting("CrashLoopBackOff", "back-off 40s"), last=ended("OOMKilled", 137, 30))
    reason, message = one([crashed])
    assert reason == "OOMKilled"
    assert "(4Gi)" in message and "spec.decode.resources.limits.memory" in message
    assert "spec.runtime.resources.limits.memory" in message and "--kv-cache-gib" in message
    router = pod(
        "llm-router-5d8", "router", state=waiting("CrashLoopBackOff"), last=ended("OOMKilled", 137, 3)
    )
    _, message = one([router])
    assert "spec.router.resources.limits.memory" in message and "--kv-cache-gib" not in message
    unlimited = pod(last=ended("OOMKilled", 137, 30), memory=None, started=False)
    assert "the node ran out of memory" in one([unlimited])[1]


def test_a_pod_serving_again_after_an_oom_kill_is_no_problem() -> None:
    assert pod_problems([pod(last=ended("OOMKilled", 137, 30), started=True, ready=True)]) == []


# ---- startup probe restarts ------------------------------------------------------------------------

COMPILING = StartupReport("compiling", 0.45, "held by --debug-hold-compiling-s (test only)")


def _killed_in_startup(**kw: Any) -> dict[str, Any]:
    # Killed after the probe's 60 s: exit 0 (the preStop hook drained the runtime, which exited).
    return pod(last=ended("Completed", 0, 58), started=False, **kw)


def test_a_restart_by_the_startup_probe_names_the_phase_the_runtime_was_in() -> None:
    lives = {"containerd://life-1": LifeMemory(COMPILING)}
    reason, message = one([_killed_in_startup()], lives=lives, budget=BudgetFacts(60, overridden=True))
    assert reason == "StartupProbeFailed"
    assert "startup probe failed for 60 s (failureThreshold 6 × periodSeconds 10)" in message
    assert "while the runtime was in phase compiling (45 %: held by --debug-hold-compiling-s" in message
    assert "spec.startup.budgetSeconds (60 s) is shorter than this start" in message
    # Still the same problem while the kubelet backs off before the next start.
    waiting_pod = pod(state=waiting("CrashLoopBackOff"), last=ended("Completed", 0, 58))
    assert one([waiting_pod], lives=lives, budget=BudgetFacts(60, True)) == (reason, message)


def test_a_probe_shorter_than_the_budget_was_changed_outside_the_operator() -> None:
    lives = {"containerd://life-1": LifeMemory(COMPILING)}
    short = pod(last=ended("Completed", 0, 29), started=False, failure_threshold=3)
    reason, message = one([short], lives=lives, budget=BudgetFacts(600, overridden=False))
    assert reason == "StartupProbeFailed" and "probe failed for 30 s" in message
    assert "less than the operator's budget (600 s)" in message and "changed outside the operator" in message


def test_the_computed_budget_too_short_points_at_the_jit_cache() -> None:
    _, message = one([_killed_in_startup()], budget=BudgetFacts(60, overridden=False))
    assert "spec.startup.jitCache.pvc" in message
    assert "did not read its startup phase" in message  # the operator restarted in between


def test_a_learned_budget_overrun_says_the_operator_answers_it() -> None:
    learned = _killed_in_startup()
    learned["metadata"]["annotations"] = {"sovereign.ai/startup-budget-source": "observed"}
    lives = {"containerd://life-1": LifeMemory(COMPILING)}
    _, message = one([learned], lives=lives, budget=BudgetFacts(60, False, "observed"))
    assert "a budget learned from observed starts, shorter than this start: the operator widens it" in message
    # Once the operator widened it, the pods that still have the old probe are no edit by someone else.
    _, message = one([learned], lives=lives, budget=BudgetFacts(120, False, "observed"))
    assert "the operator has raised the budget to 120 s (observed)" in message
    assert "outside the operator" not in message


def test_what_is_not_a_startup_probe_restart() -> None:
    budget = BudgetFacts(60, False)
    # It had started (a liveness restart later on): not a startup problem.
    started = {"containerd://life-1": LifeMemory(COMPILING, started=True)}
    assert pod_problems([_killed_in_startup()], started, budget) == []
    # Ran three hours: with no memory, far past the probe window and the grace period.
    assert pod_problems([pod(last=ended("Error", 137, 3 * 3600), started=False)], {}, budget) == []
    # Exited too early for the probe to have run out, with a crash's exit code: a crash.
    reason, _ = one([pod(last=ended("Error", 1, 4), started=False)], budget=budget)
    assert reason == "CrashLoopBackOff"
    # The new life started: solved (the Event keeps the history).
    assert pod_problems([pod(last=ended("Completed", 0, 58), started=True, ready=True)], started) == []


# ---- crash loops ------------------------------------------------------------------------------


def test_a_crash_loop_quotes_the_last_log_line_and_stays_put_between_restarts() -> None:
    log = "Traceback (most recent call last):\n  ...\nerror: --model builtin:nope: unknown builtin model\n"
    crash = ended("Error", 2, 3, message=log)
    backing_off = pod(
        state=waiting("CrashLoopBackOff", "back-off 20s restarting failed container"), last=crash
    )
    running_again = pod(last=crash, started=False)
    assert one([backing_off]) == one([running_again])
    reason, message = one([backing_off])
    assert reason == "CrashLoopBackOff"
    assert (
        "exit code 2, Error" in message and "'error: --model builtin:nope: unknown builtin model'" in message
    )
    assert "kubectl logs llm-unified-0 -c runtime --previous" in message


def test_problems_come_most_actionable_first_and_name_the_others() -> None:
    pods = [
        pod("llm-unified-2", state=waiting("CrashLoopBackOff"), last=ended("Error", 1, 2)),
        pod("llm-unified-1", state=waiting("ImagePullBackOff")),
        pod("llm-unified-0", deleting=True, state=waiting("ImagePullBackOff")),  # going away
    ]
    assert [(p.reason, p.pod) for p in pod_problems(pods)] == [
        ("ImagePullFailed", "llm-unified-1"),
        ("CrashLoopBackOff", "llm-unified-2"),
    ]


# ---- readiness --------------------------------------------------------------------------------


def test_readiness_failing_for_long_is_reported_after_the_grace() -> None:
    stuck = pod(started=True, ready=False, ready_since=T0)
    assert readiness_failing([stuck], T0_S + 60) == []
    (problem,) = readiness_failing([stuck], T0_S + 121)
    assert problem.reason == "ReadinessProbeFailing"
    assert "GET /health/ready" in problem.message and T0 in problem.message
    assert readiness_failing([pod(started=False, ready_since=T0)], T0_S + 600) == []  # still starting
    assert readiness_failing([pod(started=True, deleting=True)], T0_S + 600) == []  # draining away


# ---- startup time -----------------------------------------------------------------------------


def test_observed_startup_is_container_start_to_ready() -> None:
    ready = pod(started=True, ready=True, ready_since=at(42))
    assert observed_startup_seconds(ready) == 42
    assert observed_startup_seconds(pod(started=True, ready=False)) is None


# ---- into status ------------------------------------------------------------------------------

REF = DeploymentRef(name="llm", namespace="ns", uid="u", generation=1)


def _status(
    pods: list[dict[str, Any]],
    lives: dict[str, LifeMemory] | None = None,
    now: str = at(10),
    previous: Any = None,
) -> Any:
    spec = LLMDeploymentSpec.model_validate(with_changes(TINY_SPEC, startup={"budgetSeconds": 60}))
    rendered = render(REF, spec)
    sts = {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2},
    }
    observed = Observed(
        statefulsets={"unified": sts},
        router={"spec": {"replicas": 1}, "status": {"readyReplicas": 1}},
        pods=pods,
        lives=lives or {},
    )
    return compute_status(1, rendered, observed, previous, now)


def _cond(status: Any, kind: str) -> Any:
    return next(c for c in status.conditions if c.type == kind)


def test_status_names_the_restart_the_phases_and_the_observed_startup() -> None:
    serving = pod(
        "llm-unified-0", started=True, ready=True, ready_since=at(37), container_id="containerd://a"
    )
    restarted = _killed_in_startup(container_id="containerd://life-2")
    restarted["metadata"]["name"] = "llm-unified-1"
    lives = {
        "containerd://life-1": LifeMemory(COMPILING),
        "containerd://life-2": LifeMemory(StartupReport("loading_weights", 0.1, "")),
    }
    status = _status([serving, restarted], lives)
    degraded = _cond(status, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "StartupProbeFailed")
    assert "llm-unified-1" in degraded.message and "phase compiling" in degraded.message
    progressing = _cond(status, "Progressing")
    assert progressing.message.endswith("; starting: llm-unified-1 loading_weights")
    assert status.pools.unified.observed_startup_seconds == 37
    assert status.startup_budget.seconds == 60
    # Nothing new observed: the same status, no write.
    again = _status([copy.deepcopy(serving), copy.deepcopy(restarted)], lives, now=at(20), previous=status)
    assert status_patch(status.to_api(), again) is None


def test_readiness_failing_yields_to_harder_problems() -> None:
    stuck = pod("llm-unified-0", started=True, ready=False, ready_since=T0)
    status = _status([stuck], now=at(300))
    assert _cond(status, "Degraded").reason == "ReadinessProbeFailing"
    pulling = pod("llm-unified-1", state=waiting("ImagePullBackOff"))
    status = _status([stuck, pulling], now=at(300))
    degraded = _cond(status, "Degraded")
    assert degraded.reason == "ImagePullFailed" and "also" not in degraded.message
