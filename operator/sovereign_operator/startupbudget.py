"""Startup budgets learned from observed starts: pure functions of pods, status and the formula.

The formula (render/plan.py: base + weight load + a fixed JIT allowance) guesses how long a pod takes
to start; pods measure it. Every successful start (a container life, from its start to the pod's
Ready, by the kubelet's timestamps: the same figure as `observedStartupSeconds`) is a sample of its
profile: the model revision and precision the pod runs and its runtime image (stamped on the pod
template), and the node type it ran on (the GPU product label, or cpu). Status keeps the latest
samples per profile, bounded, so the history survives a failover of the operator.

The learned budget for the next pod of the current spec, once its profiles have samples:

    per node type:  max(p95 × HEADROOM, base + weight load)       rounded up to whole probe periods
    learned:        the largest of those (the next pod may land on any), at most the formula's cold value

When it applies: the budget is the pods' startup probe, so a new budget rolls every pod of the pool.
Samples therefore change status, never the pods: the budget in force is decided again only when the
pods roll anyway (their template changes for another reason: a new image, model, argument, ...) and
at once after an overrun. A pod the kubelet cut short under a learned budget keeps that probe until
the pod is recreated, so waiting for a rollout would be a crash loop: the first overrun widens the
budget (WIDENING × the window it overran, at most the cold value), a second consecutive one falls
back to the cold formula and says so. A successful start ends a run of overruns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sovereign_operator.api.status import StartupBudget, StartupOverrun, StartupProfile, StartupSample
from sovereign_operator.podstatus import (
    LifeMemory,
    container_statuses,
    ended_by_startup_probe,
    observed_start,
)
from sovereign_operator.render.plan import SpecKey, whole_periods
from sovereign_operator.vocabulary import (
    MODEL_PRECISION_ANNOTATION,
    MODEL_REVISION_ANNOTATION,
    WORKER_COMPONENTS,
    parse_rfc3339,
    pod_component,
)

SAMPLES_KEPT = 10
OVERRUNS_KEPT = 4
PROFILES_KEPT = 8
PERCENTILE = 0.95
HEADROOM = 1.5
WIDENING = 2
FALLBACK_AFTER = 2

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
CPU_NODE_TYPE = "cpu"
# A GPU node without the product label (no GPU feature discovery): one type for all of them.
UNLABELLED_GPU = "gpu"
RUNTIME_CONTAINER = "runtime"


@dataclass(frozen=True)
class ProfileKey:
    spec: SpecKey
    node_type: str


# ---- what pods say ---------------------------------------------------------------------------------


def _runtime_container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = (pod.get("spec") or {}).get("containers") or []
    return next(
        (c for c in containers if c.get("name") == RUNTIME_CONTAINER), containers[0] if containers else {}
    )


def _requests_gpu(container: Mapping[str, Any]) -> bool:
    resources = container.get("resources") or {}
    names = {*(resources.get("limits") or {}), *(resources.get("requests") or {})}
    return any(name.endswith("/gpu") for name in names)


def node_type(pod: Mapping[str, Any], node_labels: Mapping[str, Mapping[str, str]]) -> str | None:
    """cpu for a pod without GPUs; else its node's GPU product label. None while the node is unknown."""
    if not _requests_gpu(_runtime_container(pod)):
        return CPU_NODE_TYPE
    labels = node_labels.get(str((pod.get("spec") or {}).get("nodeName") or ""))
    if labels is None:
        return None
    return labels.get(GPU_PRODUCT_LABEL) or UNLABELLED_GPU


def pod_profile(pod: Mapping[str, Any], node_labels: Mapping[str, Mapping[str, str]]) -> ProfileKey | None:
    annotations = pod["metadata"].get("annotations") or {}
    revision, precision = (
        annotations.get(MODEL_REVISION_ANNOTATION),
        annotations.get(MODEL_PRECISION_ANNOTATION),
    )
    image = _runtime_container(pod).get("image")
    where = node_type(pod, node_labels)
    if not revision or not precision or not image or where is None:
        return None  # a pod rendered before budgets were learned, or its node not read yet
    return ProfileKey(SpecKey(str(revision), str(precision), str(image)), where)


@dataclass(frozen=True)
class Observations:
    samples: list[tuple[ProfileKey, StartupSample]] = field(default_factory=list)
    overruns: list[tuple[ProfileKey, StartupOverrun]] = field(default_factory=list)


def observe_starts(
    pods: Iterable[Mapping[str, Any]],
    node_labels: Mapping[str, Mapping[str, str]],
    lives: Mapping[str, LifeMemory],
) -> Observations:
    """The starts the worker pods show now: Ready pods' current lives, and lives the kubelet cut short
    under a learned budget (the last one per container: the kubelet keeps no more)."""
    found = Observations()
    for pod in pods:
        if pod_component(pod) not in WORKER_COMPONENTS or pod["metadata"].get("deletionTimestamp"):
            continue
        key = pod_profile(pod, node_labels)
        if key is None:
            continue
        name = str(pod["metadata"]["name"])
        start = observed_start(pod)
        if start is not None:
            found.samples.append((key, StartupSample(pod=name, started_at=start[0], seconds=start[1])))
        for status in container_statuses(pod):
            kill = ended_by_startup_probe(pod, status, lives)
            ended = (status.get("lastState") or {}).get("terminated") or {}
            if kill is None or not kill.learned or not ended.get("startedAt") or not ended.get("finishedAt"):
                continue
            overrun = StartupOverrun(
                pod=name,
                started_at=str(ended["startedAt"]),
                finished_at=str(ended["finishedAt"]),
                window_seconds=kill.window.seconds,
            )
            found.overruns.append((key, overrun))
    return found


# ---- the history in status -------------------------------------------------------------------------


def _at(text: str) -> float:
    return parse_rfc3339(text) or 0.0


def _ready_at(sample: StartupSample) -> float:
    return _at(sample.started_at) + sample.seconds


def percentile(values: Iterable[int], q: float = PERCENTILE) -> int | None:
    """Nearest-rank percentile (an observed value, never an interpolation); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def consecutive_overruns(
    samples: list[StartupSample], overruns: list[StartupOverrun]
) -> list[StartupOverrun]:
    """The overruns since the newest successful start (all of them before any)."""
    since = max((_ready_at(s) for s in samples), default=float("-inf"))
    return [o for o in overruns if _at(o.finished_at) > since]


def _profile_key(profile: StartupProfile) -> ProfileKey:
    return ProfileKey(SpecKey(profile.revision, profile.precision, profile.runtime_image), profile.node_type)


def _activity(profile: StartupProfile) -> float:
    return max(
        [_ready_at(s) for s in profile.samples] + [_at(o.finished_at) for o in profile.overruns], default=0.0
    )


def record(profiles: Iterable[StartupProfile], seen: Observations) -> list[StartupProfile]:
    """The history with what was seen added: each start once (by pod and container start), the latest
    SAMPLES_KEPT samples and OVERRUNS_KEPT overruns per profile, the PROFILES_KEPT most recently active
    profiles. A start older than every kept one is not added again (it was, and was dropped)."""
    samples: dict[ProfileKey, list[StartupSample]] = {}
    overruns: dict[ProfileKey, list[StartupOverrun]] = {}
    for profile in profiles:
        key = _profile_key(profile)
        samples[key], overruns[key] = list(profile.samples), list(profile.overruns)
    for key, sample in seen.samples:
        kept = samples.setdefault(key, [])
        overruns.setdefault(key, [])
        if any((s.pod, s.started_at) == (sample.pod, sample.started_at) for s in kept):
            continue
        if len(kept) >= SAMPLES_KEPT and _at(sample.started_at) < min(_at(s.started_at) for s in kept):
            continue
        kept.append(sample)
        kept.sort(key=lambda s: (_at(s.started_at), s.pod))
        del kept[:-SAMPLES_KEPT]
    for key, overrun in seen.overruns:
        kept_overruns = overruns.setdefault(key, [])
        samples.setdefault(key, [])
        if any((o.pod, o.started_at) == (overrun.pod, overrun.started_at) for o in kept_overruns):
            continue
        if len(kept_overruns) >= OVERRUNS_KEPT and _at(overrun.finished_at) < min(
            _at(o.finished_at) for o in kept_overruns
        ):
            continue
        kept_overruns.append(overrun)
        kept_overruns.sort(key=lambda o: (_at(o.finished_at), o.pod))
        del kept_overruns[:-OVERRUNS_KEPT]
    result = [
        StartupProfile(
            revision=key.spec.revision,
            precision=key.spec.precision,
            runtime_image=key.spec.runtime_image,
            node_type=key.node_type,
            samples=samples[key],
            overruns=overruns[key],
            p95_seconds=percentile(s.seconds for s in samples[key]),
            consecutive_overruns=len(consecutive_overruns(samples[key], overruns[key])),
        )
        for key in samples
    ]
    result.sort(key=lambda p: (-_activity(p), p.revision, p.node_type, p.runtime_image))
    return result[:PROFILES_KEPT]


# ---- the budget ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Learned:
    """What the current spec's observed starts say."""

    seconds: int | None = None  # the learned budget; None before a sample
    samples: int = 0
    p95_seconds: int | None = None  # of the node type that sets `seconds`
    node_type: str | None = None
    overruns: int = 0  # consecutive overruns of a learned budget, on the worst node type
    newest_overrun: StartupOverrun | None = None
    overrun_node_type: str | None = None


def learn(profiles: Iterable[StartupProfile], key: SpecKey, formula: StartupBudget) -> Learned:
    """The learned budget for the next pod of `key` (see the module's docstring)."""
    floor = formula.base_seconds + formula.weight_load_seconds
    cap = formula.cold_seconds or formula.seconds
    best: tuple[int, str, int] | None = None  # (seconds, node type, p95)
    count, overruns, newest, newest_node = 0, 0, None, None
    for profile in profiles:
        if _profile_key(profile).spec != key:
            continue
        count += len(profile.samples)
        p95 = percentile(s.seconds for s in profile.samples)
        if p95 is not None:
            value = min(cap, whole_periods(max(math.ceil(p95 * HEADROOM), floor)))
            if best is None or (value, profile.node_type) > (best[0], best[1]):
                best = (value, profile.node_type, p95)
        run = consecutive_overruns(profile.samples, profile.overruns)
        overruns = max(overruns, len(run))
        for overrun in run:
            if newest is None or _at(overrun.finished_at) > _at(newest.finished_at):
                newest, newest_node = overrun, profile.node_type
    if best is None:
        return Learned(samples=count, overruns=overruns, newest_overrun=newest, overrun_node_type=newest_node)
    return Learned(best[0], count, best[2], best[1], overruns, newest, newest_node)


def decide(formula: StartupBudget, learned: Learned, key: SpecKey) -> StartupBudget:
    """The budget the observations give now, from the formula's budget (plan.startup_budget)."""
    if formula.overridden:
        return formula
    cold = formula.cold_seconds or formula.seconds
    answered = {
        "overruns": learned.overruns,
        "overrun_at": learned.newest_overrun.finished_at if learned.newest_overrun else None,
    }
    newest = learned.newest_overrun
    if newest is not None and learned.overruns >= FALLBACK_AFTER:
        return formula.model_copy(
            update={
                **answered,
                "seconds": cold,
                "source": "formula",
                "reason": f"fell back to the formula's cold value ({cold} s): {learned.overruns} consecutive"
                f" starts overran the learned budget (the newest: pod {newest.pod} on"
                f" {learned.overrun_node_type}, cut short after {newest.window_seconds} s)",
            }
        )
    if newest is not None:
        widened = min(cold, whole_periods(max(learned.seconds or 0, WIDENING * newest.window_seconds)))
        return formula.model_copy(
            update={
                **answered,
                "seconds": widened,
                "source": "observed",
                "samples": learned.samples,
                "p95_seconds": learned.p95_seconds,
                "node_type": learned.node_type,
                "reason": f"widened to {widened} s: pod {newest.pod} on {learned.overrun_node_type} overran"
                f" the learned budget ({newest.window_seconds} s); {WIDENING}× that window, at most the cold"
                f" formula ({cold} s). Another overrun before a start succeeds falls back to the cold formula",
            }
        )
    if learned.seconds is None:
        return formula.model_copy(
            update={
                **answered,
                "samples": 0,
                "reason": f"no start of {key.describe()} observed yet; {formula.reason}",
            }
        )
    floor = formula.base_seconds + formula.weight_load_seconds
    assert learned.p95_seconds is not None
    raw = math.ceil(learned.p95_seconds * HEADROOM)
    reason = (
        f"learned from {learned.samples} observed starts: p95 {learned.p95_seconds} s on {learned.node_type}"
        f" × {HEADROOM:g} = {raw} s"
    )
    if raw < floor:
        reason += f", at least base + weight load ({floor} s)"
    if learned.seconds == cold and whole_periods(max(raw, floor)) > cold:
        reason += f", at most the formula's cold value ({cold} s)"
    return formula.model_copy(
        update={
            **answered,
            "seconds": learned.seconds,
            "source": "observed",
            "samples": learned.samples,
            "p95_seconds": learned.p95_seconds,
            "node_type": learned.node_type,
            "reason": reason + f" (the formula: {formula.formula_seconds} s)",
        }
    )


_FORMULA_FIELDS = (
    "base_seconds",
    "weight_load_seconds",
    "jit_seconds",
    "overridden",
    "formula_seconds",
    "cold_seconds",
)


def in_force(
    formula: StartupBudget,
    learned: Learned,
    key: SpecKey,
    template_hash: str,
    previous: StartupBudget | None,
) -> StartupBudget:
    """The budget to render: the one decided before (`previous`, from status) while the pods' template
    and the formula stay the same and no new overrun came; else decided again now."""
    candidate = decide(formula, learned, key).model_copy(update={"pod_template_hash": template_hash})
    if previous is None or previous.pod_template_hash != template_hash:
        return candidate  # the pods roll anyway (or nothing was decided yet)
    if any(getattr(previous, name) != getattr(formula, name) for name in _FORMULA_FIELDS):
        return candidate  # the spec changed what the formula gives (read bandwidth, budgetSeconds)
    if formula.overridden and previous.seconds != formula.seconds:
        return candidate
    newest = learned.newest_overrun
    if newest is not None and _at(newest.finished_at) > _at(previous.overrun_at or ""):
        return candidate  # a pod overran the budget in force: waiting would be a crash loop
    return previous


def previous_budget(status: Mapping[str, Any] | None) -> StartupBudget | None:
    """status.startupBudget as the operator wrote it (None when absent or unreadable)."""
    raw = (status or {}).get("startupBudget")
    if not isinstance(raw, dict):
        return None
    try:
        return StartupBudget.model_validate(raw)
    except ValueError:
        return None


def previous_profiles(status: Mapping[str, Any] | None) -> list[StartupProfile]:
    """status.startupObservations.profiles (empty when absent or unreadable)."""
    raw = ((status or {}).get("startupObservations") or {}).get("profiles") or []
    profiles = []
    for item in raw if isinstance(raw, list) else []:
        try:
            profiles.append(StartupProfile.model_validate(item))
        except ValueError:
            continue  # one damaged entry costs its own history, not the others'
    return profiles
