"""A huggingFace source's download as the operator sees it: facts for rendering and `status.model`.

Pure: the inputs are the previous `status.model`, the Job being watched (the resolve Job until the
commit is known, then the download Job) with its pods, the newest progress line of the running
download pod's log, and the download's cache claim with its Warning Events while it is not bound (a
claim the provisioner refuses leaves the pod waiting with no reason of its own). The download
command reports through channels that need no write access: its termination message (the kubelet
copies it into the pod's status: the commit and sizes, or the failure reason with the hub's
message) and JSON progress lines on stdout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sovereign_operator.api.spec import HuggingFaceSource
from sovereign_operator.api.status import ModelStatus, ServedModel
from sovereign_operator.render.modelcache import (
    CACHE_COMPONENT,
    CONTAINER,
    CacheObjects,
    ModelFacts,
    Resolved,
    Serving,
    cache_claim_name,
    source_hash,
)
from sovereign_operator.vocabulary import COMPONENT_LABEL, find_condition

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


@dataclass(frozen=True)
class JobView:
    """One Job as read from the apiserver: the Job (None before it exists), its pods, and the last
    lines of its running pod's log (empty when unreadable)."""

    job: Mapping[str, Any] | None = None
    pods: list[Mapping[str, Any]] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    # The download Job's cache claim, and its Warning Events while it is not Bound (read only then).
    claim: Mapping[str, Any] | None = None
    claim_events: list[Mapping[str, Any]] = field(default_factory=list)


CLAIM_PENDING = "CacheClaimPending"
# What a person changes when the claim's StorageClass cannot give it what it asks for.
CACHE_FIELDS = "spec.model.source.huggingFace.cache (storageClassName, accessMode)"


@dataclass(frozen=True)
class Assessment:
    facts: ModelFacts
    status: ModelStatus


def facts_from_status(
    source: HuggingFaceSource, default_endpoint: str, previous: Mapping[str, Any] | None
) -> ModelFacts:
    """What status already records: the resolution (while the source is unchanged) and the cache
    the pools read. Sticky, so a rollout keeps the commit it started with."""
    previous = previous or {}
    resolved = None
    if previous.get("sourceHash") == source_hash(source, default_endpoint) and previous.get("commit"):
        resolved = Resolved(
            commit=str(previous["commit"]),
            bytes_total=int(previous.get("bytesTotal") or 0),
            files=int(previous.get("files") or 0),
        )
    serving = None
    served = previous.get("serving") or {}
    if served.get("cache") and served.get("commit"):
        serving = Serving(str(served["commit"]), str(served["cache"]), int(served.get("bytesTotal") or 0))
    return ModelFacts(resolved=resolved, serving=serving)


def _newest(pods: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    ordered = sorted(pods, key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "")
    return ordered[-1] if ordered else None


def _container(pod: Mapping[str, Any] | None) -> Mapping[str, Any]:
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    return next((c for c in statuses if c.get("name") == CONTAINER), {})


def _report(terminated: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The download command's JSON result from a terminated container's message."""
    if not terminated:
        return None
    try:
        body = json.loads(terminated.get("message") or "")
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _failure(pod: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(reason, message) of the pod's latest failed attempt, if its container has failed."""
    container = _container(pod)
    for state in (container.get("state") or {}, container.get("lastState") or {}):
        terminated = state.get("terminated")
        if terminated and terminated.get("exitCode") not in (0, None):
            report = _report(terminated) or {}
            if report.get("event") == "failed":
                return str(report.get("reason") or "DownloadFailed"), str(report.get("message") or "")
            detail = terminated.get("reason") or f"exit code {terminated.get('exitCode')}"
            return "DownloadFailed", f"the download container failed ({detail}); see kubectl logs"
    return None


# Container states that wait for a person, not for time (a missing token Secret, a bad image).
_STUCK_WAITING = ("CreateContainerConfigError", "ImagePullBackOff", "ErrImagePull", "InvalidImageName")


def _stuck(pod: Mapping[str, Any] | None) -> tuple[str, str] | None:
    waiting = (_container(pod).get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in _STUCK_WAITING:
        return str(
            waiting["reason"]
        ), f"the {CONTAINER} container cannot start: {waiting.get('message') or waiting['reason']}"
    return None


def _unschedulable(pod: Mapping[str, Any] | None) -> str | None:
    scheduled = find_condition(((pod or {}).get("status") or {}).get("conditions"), "PodScheduled")
    if scheduled and scheduled.get("reason") == "Unschedulable":
        return str(scheduled.get("message") or "").strip()
    return None


def claim_bound(claim: Mapping[str, Any] | None) -> bool:
    return (((claim or {}).get("status") or {}).get("phase")) == "Bound"


def unbound_retained_cache(claim: Mapping[str, Any]) -> bool:
    """A `Retain` cache claim (no owner references) that never bound: it holds no download, so
    keeping it keeps nothing. A claim with a volume named is bound or binding; one `Lost` had one."""
    meta = claim.get("metadata") or {}
    return (
        (meta.get("labels") or {}).get(COMPONENT_LABEL) == CACHE_COMPONENT
        and not meta.get("ownerReferences")
        and ((claim.get("status") or {}).get("phase") or "Pending") == "Pending"
        and not (claim.get("spec") or {}).get("volumeName")
    )


def unbound_claim_fate(appliers: set[str], owner_uid: str | None, live_uids: set[str]) -> str | None:
    """What `owner_uid` (None: nobody in particular, after a deletion) does with an unbound
    `Retain` cache claim it no longer renders, given the uids of the LLMDeployments that applied it
    and of those that still exist: "delete" when no other existing one applied it, "release" (drop
    only its own fields) when others still may use it, None when it is not its to touch (applied
    by none of ours: someone made it by hand)."""
    if not appliers:
        return None
    if not {uid for uid in appliers if uid in live_uids and uid != owner_uid}:
        return "delete"
    return "release" if owner_uid in appliers else None


def _event_time(event: Mapping[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def _claim_pending(
    claim: Mapping[str, Any] | None, events: Iterable[Mapping[str, Any]], pod: Mapping[str, Any] | None
) -> str | None:
    """Why the cache claim is not bound, while it holds the download pod back: the newest Warning
    Event on the claim (the PV controller's or the provisioner's own words), or None when the claim
    is bound, the pod already has a node, or nothing has complained yet (provisioning takes time)."""
    if claim is None or claim_bound(claim):
        return None
    if ((pod or {}).get("spec") or {}).get("nodeName"):
        return None
    warnings = [e for e in events if e.get("type") == "Warning"]
    if not warnings:
        return None
    newest = max(warnings, key=_event_time)
    spec = claim.get("spec") or {}
    modes = ", ".join(spec.get("accessModes") or []) or "no access mode"
    klass = spec.get("storageClassName")
    where = f"StorageClass {klass}" if klass else "the default StorageClass"
    name = (claim.get("metadata") or {}).get("name")
    said = str(newest.get("message") or "").strip()
    return (
        f"the cache claim {name} ({modes}, {where}) is not bound, so the download pod cannot start:"
        f" {newest.get('reason') or 'Warning'}: {said}. Check {CACHE_FIELDS} against the classes"
        " the cluster offers (kubectl get storageclass)"
    )


def _job_condition(job: Mapping[str, Any] | None, kind: str) -> bool:
    condition = find_condition(((job or {}).get("status") or {}).get("conditions"), kind)
    return bool(condition and condition.get("status") == "True")


def latest_progress(lines: Iterable[str]) -> dict[str, Any] | None:
    """The newest `progress` event among the log lines (other lines are skipped)."""
    found = None
    for line in lines:
        text = line.strip()
        if not text.startswith("{"):
            continue
        try:
            event = json.loads(text)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "progress":
            found = event
    return found


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}GiB"


def _duration(seconds: int) -> str:
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def progress_line(status: ModelStatus) -> str:
    """The Download column: short enough for `kubectl get llmd`."""
    if status.phase in ("Retrying", "Failed"):
        return f"{status.phase}: {status.reason or 'DownloadFailed'}"
    if status.reason in (CLAIM_PENDING, "Unschedulable"):
        return f"{status.phase}: {status.reason}"  # waiting for a person, not for bytes
    if status.phase != "Downloading" or not status.bytes_total:
        return status.phase
    done = status.bytes_done or 0
    line = f"{100 * done // status.bytes_total}% of {_gib(status.bytes_total)}"
    if status.eta_seconds is not None and done < status.bytes_total:
        line += f", ETA {_duration(status.eta_seconds)}"
    return line


def assess(
    source: HuggingFaceSource,
    default_endpoint: str,
    previous: Mapping[str, Any] | None,
    known: ModelFacts,
    objects: CacheObjects,
    view: JobView,
) -> Assessment:
    """The facts for rendering and the status after looking at the watched Job.

    `known` are the facts status recorded (facts_from_status) and `objects` what was rendered from
    them: the resolve Job until the commit is known, then the claim and its download Job.
    """
    previous = previous or {}
    job, pod = view.job, _newest(view.pods)
    container = _container(pod)
    restarts = int(container.get("restartCount") or 0)
    failure = _failure(pod) or _stuck(pod)
    base: dict[str, Any] = {
        "repo": source.repo,
        "revision": source.revision,
        "source_hash": objects.source_hash,
        "attempts": restarts + 1 if pod is not None else None,
    }

    if known.resolved is None:
        report = _report((container.get("state") or {}).get("terminated"))
        if report and report.get("event") == "resolved" and report.get("commit"):
            resolved = Resolved(
                str(report["commit"]), int(report.get("bytesTotal") or 0), int(report.get("files") or 0)
            )
            facts = ModelFacts(resolved=resolved, serving=known.serving)
            status = ModelStatus(
                **base,
                commit=resolved.commit,
                cache=cache_claim_name(source, resolved.commit),
                phase="Downloading",
                bytes_total=resolved.bytes_total,
                bytes_done=0,
                files=resolved.files,
                files_done=0,
                progress="",
                serving=_served(known.serving),
            )
            # The claim is named after the commit: rendering with the new facts creates it.
            return Assessment(facts, _finish(status))
        phase, reason, message = "Resolving", None, None
        if _job_condition(job, "Complete"):
            # Finished, but its pod (and so its answer) is gone or says nothing: resolve again.
            phase, reason = "Retrying", "NoResult"
            message = (
                "the resolve Job finished without a result in its pod's termination message; it runs again"
            )
        elif _job_condition(job, "Failed"):
            phase, (reason, message) = "Failed", _gave_up(failure, previous, view.job)
        elif failure is not None:
            phase, (reason, message) = "Retrying", failure
        elif (why := _unschedulable(pod)) is not None:
            reason, message = "Unschedulable", f"the resolve pod cannot be scheduled: {why}"
        status = ModelStatus(
            **base, phase=phase, reason=reason, message=message, progress="", serving=_served(known.serving)
        )
        return Assessment(known, _finish(status))

    resolved = known.resolved
    complete = _job_condition(job, "Complete")
    facts = ModelFacts(resolved=resolved, complete=complete, serving=known.serving)
    common = {
        **base,
        "commit": resolved.commit,
        "cache": objects.cache_name,
        "bytes_total": resolved.bytes_total,
        "files": resolved.files,
    }
    if complete:
        serving = Serving(resolved.commit, objects.cache_name or "", resolved.bytes_total)
        status = ModelStatus(
            **common,
            phase="Complete",
            bytes_done=resolved.bytes_total,
            files_done=resolved.files,
            progress="",
            serving=_served(serving),
        )
        return Assessment(ModelFacts(resolved=resolved, complete=True, serving=serving), _finish(status))

    progress = latest_progress(view.log_lines) or {}
    if not progress and previous.get("commit") == resolved.commit:
        # The log is unreadable (or the pod restarting): keep the last figures rather than zero.
        progress = {k: previous.get(k) for k in ("bytesDone", "filesDone") if previous.get(k) is not None}
    numbers = {
        "bytes_done": progress.get("bytesDone", 0),
        "files_done": progress.get("filesDone", 0),
        "rate_bytes_per_second": progress.get("rateBytesPerSecond"),
        "eta_seconds": progress.get("etaSeconds"),
    }
    phase, reason, message = "Downloading", None, None
    if _job_condition(job, "Failed"):
        phase, (reason, message) = "Failed", _gave_up(failure, previous, view.job)
        numbers.update(rate_bytes_per_second=None, eta_seconds=None)
    elif failure is not None:
        reason, message = failure
        running = (container.get("state") or {}).get("running") is not None
        if not running:
            phase = "Retrying"
            numbers.update(rate_bytes_per_second=None, eta_seconds=None)
    elif (why := _claim_pending(view.claim, view.claim_events, pod)) is not None:
        reason, message = CLAIM_PENDING, why
    elif (why := _unschedulable(pod)) is not None:
        reason, message = "Unschedulable", f"the download pod cannot be scheduled: {why}"
    status = ModelStatus(
        **common,
        **numbers,
        phase=phase,
        reason=reason,
        message=message,
        progress="",
        serving=_served(known.serving),
    )
    return Assessment(facts, _finish(status))


def _gave_up(
    failure: tuple[str, str] | None, previous: Mapping[str, Any], job: Mapping[str, Any] | None
) -> tuple[str, str]:
    """A Job past its backoff limit: the last failure seen (its pod may be gone) and what to do."""
    reason = failure[0] if failure else str(previous.get("reason") or "DownloadFailed")
    message = failure[1] if failure else str(previous.get("message") or "")
    name = ((job or {}).get("metadata") or {}).get("name")
    advice = f"the Job gave up retrying; fix the cause, then `kubectl delete job {name}` and the operator starts it again"
    return reason, f"{message} ({advice})" if message else advice


def _served(serving: Serving | None) -> ServedModel | None:
    if serving is None:
        return None
    return ServedModel(commit=serving.commit, cache=serving.cache, bytes_total=serving.bytes_total)


def _finish(status: ModelStatus) -> ModelStatus:
    return status.model_copy(update={"progress": progress_line(status)})
