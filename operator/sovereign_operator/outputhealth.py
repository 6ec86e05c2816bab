"""The `OutputHealthy` condition and the optional restart of pods whose output self-test fails. Pure.

Each runtime pod runs a known-answer self-test (batch invariance, numerics, weights, exact answers) before
it reports ready and periodically after; while it fails, the pod answers `/health/ready` 503 and its
`/health/startup` body names the failing check (`self_test.failing_check`, `self_test.reason`). The
operator reads that body from every running pod of each pool, turns it into one condition per deployment
(the failing pods and checks by pool), and, only with `spec.remediation.restartOnOutputFailure`, deletes
one failing pod of a pool at a time with exponential backoff so a fresh start re-compiles its kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sovereign_operator.vocabulary import OUTPUT_HEALTHY  # noqa: F401  (re-exported: the condition's type)

SELF_TEST_FAILING = "SelfTestFailing"
UNREACHABLE = "Unreachable"
NOT_REPORTED = "SelfTestNotReported"
HEALTHY = "SelfTestsPassing"
_MAX_PODS_NAMED = 3


@dataclass(frozen=True)
class OutputReport:
    """One pod's `/health/startup` answer (the JSON body, 200 or 503), or why there is none."""

    pod: str
    component: str
    body: Mapping[str, Any] | None = None
    error: str | None = None
    uid: str = ""  # the pod object's uid: a StatefulSet's replacement pod keeps the name, not the uid

    @property
    def self_test(self) -> Mapping[str, Any] | None:
        st = (self.body or {}).get("self_test")
        return st if isinstance(st, Mapping) else None

    @property
    def failing_check(self) -> str | None:
        """The failing check's name while the pod's last self-test failed; None otherwise."""
        st = self.self_test
        if st is None or st.get("passed") is not False:
            return None
        return str(st.get("failing_check") or "self_test")

    @property
    def reason(self) -> str:
        st = self.self_test or {}
        return str(st.get("reason") or st.get("failing_check") or "self-test failed")[:300]


def failing_pods(reports: Sequence[OutputReport]) -> dict[str, list[OutputReport]]:
    """Component -> the reports of its pods whose last self-test failed, by pod name."""
    out: dict[str, list[OutputReport]] = {}
    for r in sorted(reports, key=lambda r: r.pod):
        if r.failing_check is not None:
            out.setdefault(r.component, []).append(r)
    return out


def output_condition_fields(reports: Sequence[OutputReport]) -> tuple[str, str, str]:
    """(status, reason, message) of `OutputHealthy` from one answer per running pod.

    False when any pod's self-test fails (the message names pool, pod and check; at most three pods per
    pool, the rest counted); Unknown when no pod reported a self-test yet or some could not be read;
    True when every pod's last self-test passed. Messages hold no times, so a steady state keeps them.
    """
    failing = failing_pods(reports)
    if failing:
        parts = []
        for component in sorted(failing):
            pods = failing[component]
            shown = "; ".join(f"{r.pod} fails {r.failing_check} ({r.reason})" for r in pods[:_MAX_PODS_NAMED])
            more = len(pods) - _MAX_PODS_NAMED
            parts.append(f"{component}: {shown}" + (f" and {more} more" if more > 0 else ""))
        return (
            "False",
            SELF_TEST_FAILING,
            "output self-test failing, pods out of the Service and of autoscaler capacity: "
            + " | ".join(parts)
            + ". See sovereign:self_test_check_passing and docs/troubleshooting.md.",
        )
    unreachable = [r for r in reports if r.body is None]
    if unreachable:
        first = unreachable[0]
        names = ", ".join(r.pod for r in unreachable[:_MAX_PODS_NAMED])
        return "Unknown", UNREACHABLE, f"GET /health/startup failed on {names} ({first.error or 'no answer'})"
    reported = [r for r in reports if r.self_test is not None]
    if not reported:
        return "Unknown", NOT_REPORTED, "no pod has reported an output self-test yet"
    counts: dict[str, int] = {}
    for r in reported:
        counts[r.component] = counts.get(r.component, 0) + 1
    summary = ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
    return "True", HEALTHY, f"the last output self-test passed on every reporting pod ({summary})"


# ---- remediation ------------------------------------------------------------------------------


@dataclass
class RestartMemory:
    """What the operator remembers per deployment between rounds (in process; restarts are rare)."""

    restarts: int = 0  # restarts so far, for the backoff exponent; reset after a healthy round
    last_restart_at: float | None = None
    # component -> (name, uid) of the pod deleted, until a new pod of that name reports a self-test
    in_progress: dict[str, tuple[str, str]] = field(default_factory=dict)


def restart_backoff_s(restarts: int, base_s: float, cap_s: float) -> float:
    """Wait before restart number ``restarts + 1``: base, 2x base, 4x base, ... capped at ``cap_s``."""
    return min(cap_s, base_s * 2 ** min(restarts, 30))


def choose_restarts(
    reports: Sequence[OutputReport],
    memory: RestartMemory,
    now: float,
    base_s: float,
    cap_s: float,
) -> list[OutputReport]:
    """The failing pods to delete this round: at most one per pool, none while a pool's last restarted
    pod has not come back and reported a self-test, none before the backoff since the last restart.
    Updates ``memory`` for the pods it returns (the caller deletes them)."""
    for component, (name, uid) in list(memory.in_progress.items()):
        if any(r.pod == name and r.uid != uid and r.self_test is not None for r in reports):
            del memory.in_progress[component]  # the replacement started and ran its self-test
    failing = failing_pods(reports)
    if not failing:
        if not memory.in_progress:
            memory.restarts = 0
        return []
    if memory.last_restart_at is not None and now - memory.last_restart_at < restart_backoff_s(
        memory.restarts - 1 if memory.restarts else 0, base_s, cap_s
    ):
        return []
    chosen: list[OutputReport] = []
    for component in sorted(failing):
        if component in memory.in_progress:
            continue  # never more than one pod of a pool at a time
        victim = failing[component][0]
        chosen.append(victim)
        memory.in_progress[component] = (victim.pod, victim.uid)
    if chosen:
        memory.restarts += 1
        memory.last_restart_at = now
    return chosen
