"""`OutputHealthy` from the pods' self-test reports, and the restart policy for failing pods."""

from __future__ import annotations

from typing import Any

from sovereign_operator.outputhealth import (
    HEALTHY,
    NOT_REPORTED,
    SELF_TEST_FAILING,
    UNREACHABLE,
    OutputReport,
    RestartMemory,
    choose_restarts,
    output_condition_fields,
    restart_backoff_s,
)


def _body(passed: bool | None, check: str = "batch_invariance") -> dict[str, Any]:
    body: dict[str, Any] = {"phase": "ready"}
    if passed is not None:
        body["self_test"] = {
            "passed": passed,
            "failing_check": None if passed else check,
            "reason": None if passed else f"{check}: prompt 0 in a batch of 3: token 24 vs 37",
        }
    return body


def _report(
    pod: str, passed: bool | None, component: str = "decode", uid: str = "u1", **kw: Any
) -> OutputReport:
    return OutputReport(pod, component, _body(passed, **kw), uid=uid)


def test_all_passing_is_true() -> None:
    status, reason, message = output_condition_fields(
        [_report("tiny-decode-0", True), _report("tiny-decode-1", True)]
    )
    assert (status, reason) == ("True", HEALTHY) and "2 decode" in message


def test_a_failing_pod_makes_it_false_naming_pool_pod_and_check() -> None:
    reports = [
        _report("tiny-decode-0", True),
        _report("tiny-decode-1", False, check="numerics"),
        _report("tiny-prefill-0", False, component="prefill"),
    ]
    status, reason, message = output_condition_fields(reports)
    assert (status, reason) == ("False", SELF_TEST_FAILING)
    assert "decode: tiny-decode-1 fails numerics" in message
    assert "prefill: tiny-prefill-0 fails batch_invariance" in message
    assert "tiny-decode-0" not in message


def test_many_failing_pods_are_counted_not_listed() -> None:
    reports = [_report(f"tiny-decode-{i}", False) for i in range(5)]
    _, _, message = output_condition_fields(reports)
    assert "and 2 more" in message and "tiny-decode-4" not in message


def test_unknown_until_reported_and_when_unreachable() -> None:
    assert output_condition_fields([_report("p", None)])[:2] == ("Unknown", NOT_REPORTED)
    gone = OutputReport("tiny-decode-0", "decode", error="connection refused")
    status, reason, message = output_condition_fields([gone, _report("tiny-decode-1", True)])
    assert (status, reason) == ("Unknown", UNREACHABLE) and "connection refused" in message


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [restart_backoff_s(n, 60, 600) for n in range(6)] == [60, 120, 240, 480, 600, 600]


def test_restarts_one_pod_per_pool_at_a_time_with_backoff() -> None:
    mem = RestartMemory()
    failing = [_report("tiny-decode-0", False, uid="a"), _report("tiny-decode-1", False, uid="b")]
    first = choose_restarts(failing, mem, now=0.0, base_s=60, cap_s=600)
    assert [r.pod for r in first] == ["tiny-decode-0"]
    # The deleted pod has not come back: nothing else of that pool is touched, however long it takes.
    assert choose_restarts(failing[1:], mem, now=1000.0, base_s=60, cap_s=600) == []
    # Its replacement (same name, new uid) reports a failing self-test again; backoff 60 s from t=0 passed.
    again = [_report("tiny-decode-0", False, uid="a2"), failing[1]]
    assert [r.pod for r in choose_restarts(again, mem, now=1001.0, base_s=60, cap_s=600)] == ["tiny-decode-0"]
    # The second restart waits 120 s.
    back = [_report("tiny-decode-0", False, uid="a3"), failing[1]]
    assert choose_restarts(back, mem, now=1100.0, base_s=60, cap_s=600) == []
    assert [r.pod for r in choose_restarts(back, mem, now=1122.0, base_s=60, cap_s=600)] == ["tiny-decode-0"]


def test_pools_are_independent_and_a_healthy_round_resets_the_backoff() -> None:
    mem = RestartMemory()
    reports = [_report("tiny-decode-0", False), _report("tiny-prefill-0", False, component="prefill")]
    assert sorted(r.pod for r in choose_restarts(reports, mem, 0.0, 60, 600)) == [
        "tiny-decode-0",
        "tiny-prefill-0",
    ]
    healed = [
        _report("tiny-decode-0", True, uid="n1"),
        _report("tiny-prefill-0", True, component="prefill", uid="n2"),
    ]
    assert choose_restarts(healed, mem, 10.0, 60, 600) == [] and mem.restarts == 0 and not mem.in_progress
