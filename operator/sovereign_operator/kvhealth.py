"""The `KVTransferHealthy` condition: what the pods' `GET /health/kv` answers say, as one condition.

Pure: per-pod answers (or the scrape error) in, a condition dict out. The KV-health monitor
(kvmonitor.py, driven by the operator's loop) collects the answers and writes the condition; the
reconciler reads it back and turns `Degraded` True while it is False, so a silent RDMA fallback
cannot hide behind Ready.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sovereign_operator import vocabulary
from sovereign_operator.vocabulary import KV_TRANSFER_HEALTHY, rfc3339

# Reasons of a False condition, most serious first; the condition's reason is the first present.
TRANSFER_FAILING = "TransferFailing"
UNREACHABLE = "Unreachable"
FALLING_BACK = "FallingBack"
RDMA_NOT_IN_USE = "RDMANotInUse"
PODS_NOT_READY = "PodsNotReady"
HEALTHY = "TransfersHealthy"
# Transports the runtime reports for RDMA (NIXL is the library behind `--kv-transport rdma`).
_RDMA_NAMES = {"rdma", "nixl"}
KV_COMPONENTS = ("prefill", "decode")
# A message names at most this many pods per problem; the rest are counted.
_MAX_PODS_NAMED = 3


@dataclass(frozen=True)
class KVReport:
    """One pod's `/health/kv` answer: the JSON body (200 or 503), or why there is none."""

    pod: str
    component: str
    body: Mapping[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class Counters:
    """Cumulative counters of one pod's last answer, to tell new fallbacks from old ones."""

    fallbacks: int = 0
    failed: int = 0


def counters(report: KVReport) -> Counters | None:
    if report.body is None:
        return None
    return Counters(
        fallbacks=_int(report.body.get("fallbacks")), failed=_int(report.body.get("transfers_failed"))
    )


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _names(pods: Sequence[str]) -> str:
    shown = ", ".join(pods[:_MAX_PODS_NAMED])
    more = len(pods) - _MAX_PODS_NAMED
    return shown + (f" and {more} more" if more > 0 else "")


def _transport(body: Mapping[str, Any]) -> str:
    value = body.get("transport")
    return str(value) if value else "unknown"


def _last_error(body: Mapping[str, Any]) -> str:
    error = body.get("last_error")
    if not error:
        return ""
    when = body.get("last_error_time")
    at = f" at {rfc3339(float(when))}" if isinstance(when, int | float) else ""
    return f"; last error{at}: {str(error)[:300]}"


def kv_condition_fields(
    mode: str | None,
    requested_transport: str | None,
    ready_pods: Mapping[str, int],
    reports: Sequence[KVReport],
    previous: Mapping[str, Counters] | None = None,
) -> tuple[str, str, str] | None:
    """(status, reason, message) of `KVTransferHealthy`; None where the condition must be absent.

    `ready_pods` counts the ready pods per component (`prefill`, `decode`); `reports` holds one
    answer per ready pod that was scraped; `previous` the counters of the last round, so only
    fallbacks since then count (on the first round, a pod that only ever fell back counts).
    Messages hold no counters or ages, so a steady deployment keeps the same condition.
    """
    if mode != "disaggregated":
        return None
    waiting = [c for c in KV_COMPONENTS if ready_pods.get(c, 0) < 1]
    if waiting or not reports:
        pools = ", ".join(f"{c} {ready_pods.get(c, 0)} ready" for c in KV_COMPONENTS)
        return "Unknown", PODS_NOT_READY, f"waiting for ready prefill and decode pods to report ({pools})"

    previous = previous or {}
    wants_rdma = requested_transport == "rdma"
    failing: list[KVReport] = []
    unreachable: list[KVReport] = []
    falling_back: list[KVReport] = []
    not_rdma: list[KVReport] = []
    for report in sorted(reports, key=lambda r: r.pod):
        body = report.body
        if body is None:
            unreachable.append(report)
            continue
        if body.get("healthy") is False:
            failing.append(report)
        now = counters(report) or Counters()
        before = previous.get(report.pod)
        if before is not None and now.fallbacks > before.fallbacks:
            falling_back.append(report)
        elif before is None and now.fallbacks > 0 and _int(body.get("transfers_ok")) == 0:
            falling_back.append(report)  # first look: it has fallen back and never transferred
        if wants_rdma and _transport(body) not in _RDMA_NAMES:
            not_rdma.append(report)

    problems: list[tuple[str, str]] = []
    if failing:
        details = "; ".join(
            f"{r.pod} ({r.component}, {_transport(r.body or {})}"
            + (f", {r.body.get('address')}" if r.body and r.body.get("address") else "")
            + ")"
            + _last_error(r.body or {})
            for r in failing[:_MAX_PODS_NAMED]
        )
        more = len(failing) - _MAX_PODS_NAMED
        problems.append(
            (
                TRANSFER_FAILING,
                f"KV transfer failing on {len(failing)} pod(s): {details}"
                + (f" (and {more} more)" if more > 0 else "")
                + ". Check that prefill pods reach the decode pods' kv port and read kubectl logs of the pods.",
            )
        )
    if unreachable:
        first = unreachable[0]
        problems.append(
            (
                UNREACHABLE,
                f"GET /health/kv failed on {_names([r.pod for r in unreachable])} ({first.error or 'no answer'})."
                " The pods are Ready but the operator cannot read their KV health: check NetworkPolicies"
                " and that the runtime image serves /health/kv.",
            )
        )
    if falling_back:
        transports = sorted({_transport(r.body or {}) for r in falling_back})
        problems.append(
            (
                FALLING_BACK,
                f"decode pods {_names([r.pod for r in falling_back])} fall back to local prefill"
                f" (transport {'/'.join(transports)}): the KV transfer from prefill does not arrive"
                + _last_error(falling_back[0].body or {})
                + ". See sovereign:kv_transfer_fallbacks_total and the pods' logs.",
            )
        )
    if not_rdma:
        transports = sorted({_transport(r.body or {}) for r in not_rdma})
        problems.append(
            (
                RDMA_NOT_IN_USE,
                f"RDMA was requested (status.kvTransport rdma) but {_names([r.pod for r in not_rdma])}"
                f" report{'s' if len(not_rdma) == 1 else ''} transport {'/'.join(transports)}: KV goes over TCP,"
                " much slower. Check that the"
                " pods got the RDMA device and run with --kv-transport rdma (kubectl describe pod).",
            )
        )
    if problems:
        return "False", problems[0][0], " ".join(message for _, message in problems)

    transport = "/".join(sorted({_transport(r.body or {}) for r in reports}))
    counts = ", ".join(
        f"{sum(1 for r in reports if r.component == c)} {c}" for c in KV_COMPONENTS if ready_pods.get(c)
    )
    return "True", HEALTHY, f"{counts} pod(s) report healthy KV transfer over {transport}"


def kv_condition(
    fields: tuple[str, str, str],
    previous: Mapping[str, Any] | None,
    now: float,
    observed_generation: int | None = None,
) -> dict[str, Any]:
    """The condition as status holds it; the transition time moves only when the status flips."""
    status, reason, message = fields
    return vocabulary.condition(
        KV_TRANSFER_HEALTHY, status, reason, message[:2000], rfc3339(now), previous, observed_generation
    )


def conditions_patch(
    status: Mapping[str, Any] | None, condition: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """A status merge patch putting (or, with None, removing) the condition; None when it already
    says that. Every other writer's conditions are kept."""
    return vocabulary.conditions_patch(status, KV_TRANSFER_HEALTHY, condition)
