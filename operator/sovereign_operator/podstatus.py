"""What pods say about why they do not serve, and how long they took to start: pure functions of pod
dicts as the apiserver returns them.

Degraded's reasons come from here, one stable word per kind of failure so a person can alert on it;
each message names the pod and what to do. A container "life" is one run of a container (one
containerID); the startup monitor (startupmonitor.py) remembers per life the last phase the runtime
reported on `/health/startup` and whether it started, which lets a restart by the startup probe name
the phase the runtime was in. Nothing here reads a clock: `now` is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from sovereign_operator.vocabulary import (
    BUDGET_SOURCE_ANNOTATION,
    parse_rfc3339,
    pod_component,
    pod_condition,
)

# ---- reasons (Degraded and Events) -----------------------------------------------------------------

IMAGE_PULL_FAILED = "ImagePullFailed"
OOM_KILLED = "OOMKilled"
STARTUP_PROBE_FAILED = "StartupProbeFailed"
CRASH_LOOP = "CrashLoopBackOff"
UNSCHEDULABLE = "Unschedulable"
READINESS_PROBE_FAILING = "ReadinessProbeFailing"
# The kubelet's own reasons, kept as they are: each names a problem of the pod's configuration.
CONTAINER_CONFIG_REASONS = (
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "PreStartHookError",
    "PostStartHookError",
)
# Waiting reasons of a container whose image the kubelet cannot get. It alternates between
# ErrImagePull and ImagePullBackOff as it retries, so they share one reason (one status write).
IMAGE_PULL_WAITING = (
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "InvalidImageName",
    "RegistryUnavailable",
    "ErrImageInspect",
    "SignatureValidationFailed",
)
# A started container Ready=False this long is reported (a probe that never succeeds).
READINESS_GRACE_SECONDS = 120
# Exit codes of a container the kubelet stopped (SIGKILL, SIGTERM) or that exited cleanly on its
# SIGTERM (the runtime drains and exits 0): a stop from outside, not a crash.
STOPPED_EXIT_CODES = (0, 137, 143)
# The spec field that sizes each component's pods.
POOL_FIELD = {"prefill": "prefill", "decode": "decode", "unified": "decode", "router": "router"}
MAX_QUOTED_LOG = 300


@dataclass(frozen=True)
class StartupReport:
    """One answer of the runtime's `/health/startup` while it starts."""

    phase: str
    progress: float | None = None
    detail: str = ""

    def describe(self) -> str:
        text = f"phase {self.phase}"
        if self.progress is not None:
            text += f" ({100 * self.progress:.0f} %"
            text += f": {self.detail})" if self.detail else ")"
        return text


@dataclass(frozen=True)
class LifeMemory:
    """What the startup monitor saw of one container life."""

    last_report: StartupReport | None = None
    started: bool = False


@dataclass(frozen=True)
class PodProblem:
    reason: str
    message: str
    pod: str
    rank: int  # lower: shown first (what a change of spec or cluster fixes comes before what waits)


@dataclass(frozen=True)
class ProbeWindow:
    """How long a container's startup probe lets it start before the kubelet restarts it."""

    initial_delay: int
    period: int
    failures: int

    @property
    def seconds(self) -> int:
        return self.initial_delay + self.period * self.failures

    def describe(self) -> str:
        delay = f"initialDelaySeconds {self.initial_delay} + " if self.initial_delay else ""
        return f"{self.seconds} s ({delay}failureThreshold {self.failures} × periodSeconds {self.period})"


# ---- reading one pod ---------------------------------------------------------------------------------


def _name(pod: Mapping[str, Any]) -> str:
    return str(pod["metadata"]["name"])


def container_statuses(pod: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    status = pod.get("status") or {}
    yield from status.get("initContainerStatuses") or ()
    yield from status.get("containerStatuses") or ()


def container_spec(pod: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    spec = pod.get("spec") or {}
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        if container.get("name") == name:
            return container  # type: ignore[no-any-return]
    return {}


def startup_window(pod: Mapping[str, Any], container: str) -> ProbeWindow | None:
    probe = container_spec(pod, container).get("startupProbe")
    if not probe:
        return None
    return ProbeWindow(
        int(probe.get("initialDelaySeconds") or 0),
        int(probe.get("periodSeconds") or 10),
        int(probe.get("failureThreshold") or 3),
    )


def current_life(pod: Mapping[str, Any], status: Mapping[str, Any]) -> str | None:
    """The id of the container's running life (its containerID), None when it does not run."""
    running = (status.get("state") or {}).get("running")
    if running is None:
        return None
    return (
        status.get("containerID")
        or f"{pod['metadata'].get('uid')}/{status.get('name')}/{running.get('startedAt')}"
    )


def previous_life(pod: Mapping[str, Any], status: Mapping[str, Any]) -> str | None:
    """The id of the container's last ended life, None before its first restart."""
    ended = (status.get("lastState") or {}).get("terminated")
    if ended is None:
        return None
    return (
        ended.get("containerID")
        or f"{pod['metadata'].get('uid')}/{status.get('name')}/{ended.get('startedAt')}"
    )


def referenced_lives(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    lives = set()
    for pod in pods:
        for status in container_statuses(pod):
            lives.update(life for life in (current_life(pod, status), previous_life(pod, status)) if life)
    return lives


def _duration(ended: Mapping[str, Any]) -> float | None:
    start, finish = parse_rfc3339(ended.get("startedAt")), parse_rfc3339(ended.get("finishedAt"))
    return None if start is None or finish is None else finish - start


def _last_log_line(ended: Mapping[str, Any]) -> str:
    """The last line the container wrote (terminationMessagePolicy FallbackToLogsOnError)."""
    lines = [line.strip() for line in str(ended.get("message") or "").splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    return line if len(line) <= MAX_QUOTED_LOG else line[: MAX_QUOTED_LOG - 1] + "…"


def _memory_limit(pod: Mapping[str, Any], container: str) -> str | None:
    limits = (container_spec(pod, container).get("resources") or {}).get("limits") or {}
    memory = limits.get("memory")
    return None if memory is None else str(memory)


@dataclass(frozen=True)
class StartupKill:
    """A container life the kubelet ended because its startup probe ran out."""

    pod: str
    container: str
    component: str | None
    window: ProbeWindow
    ran_seconds: float | None
    report: StartupReport | None
    # The pod's budget was learned from observed starts (its template says so): the operator widens it.
    learned: bool = False


def startup_kill(
    pod: Mapping[str, Any], status: Mapping[str, Any], lives: Mapping[str, LifeMemory]
) -> StartupKill | None:
    """The container's last life ended by its startup probe, while its current life has not started."""
    return None if status.get("started") is True else ended_by_startup_probe(pod, status, lives)


def ended_by_startup_probe(
    pod: Mapping[str, Any], status: Mapping[str, Any], lives: Mapping[str, LifeMemory]
) -> StartupKill | None:
    """The container's last life, when the kubelet ended it because its startup probe ran out.

    The kubelet records no cause in the pod's status, so it is read off what it does record: the life
    ended from outside (exit 0 after SIGTERM, 137, 143; not OOMKilled) after running about as long as
    the probe allows, and it never started (what the monitor saw; without that memory, the run time
    must also fit the probe window plus the grace period)."""
    ended = (status.get("lastState") or {}).get("terminated")
    if ended is None or ended.get("reason") == "OOMKilled":
        return None
    window = startup_window(pod, str(status.get("name")))
    if window is None or ended.get("exitCode") not in STOPPED_EXIT_CODES:
        return None
    ran = _duration(ended)
    memory = lives.get(previous_life(pod, status) or "")
    if memory is not None and memory.started:
        return None
    earliest = window.seconds - window.period  # the first probe runs at once, then every period
    if ran is not None and ran < earliest:
        return None
    if memory is None:
        grace = int((pod.get("spec") or {}).get("terminationGracePeriodSeconds") or 30)
        if ran is None or ran > window.seconds + grace + 2 * window.period:
            return None
    annotations = pod["metadata"].get("annotations") or {}
    return StartupKill(
        _name(pod),
        str(status.get("name")),
        pod_component(pod),
        window,
        ran,
        memory.last_report if memory else None,
        learned=annotations.get(BUDGET_SOURCE_ANNOTATION) == "observed",
    )


def oom_killed(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The termination of the container's current or last life when it was OOM-killed."""
    for state in (status.get("state") or {}, status.get("lastState") or {}):
        ended = state.get("terminated")
        if ended and ended.get("reason") == "OOMKilled":
            return ended  # type: ignore[no-any-return]
    return None


def started_and_ready(status: Mapping[str, Any]) -> bool:
    return status.get("started") is True and status.get("ready") is True


# ---- messages ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetFacts:
    """The startup budget the operator rendered (status.startupBudget)."""

    seconds: int
    overridden: bool
    source: str = "formula"


def startup_kill_message(kill: StartupKill, budget: BudgetFacts | None) -> str:
    where = f"pod {kill.pod}" + (f" ({kill.component})" if kill.component else "")
    text = f"the kubelet restarted {where}: its startup probe failed for {kill.window.describe()}"
    if kill.report is not None:
        text += f" while the runtime was in {kill.report.describe()}"
    else:
        text += " (the operator did not read its startup phase before)"
    if kill.learned:
        # Its probe came from observed starts: the operator answers the overrun itself (startupbudget.py).
        if budget is not None and kill.window.seconds < budget.seconds:
            return (
                text + f". That was a budget learned from observed starts; the operator has raised the"
                f" budget to {budget.seconds} s ({budget.source}) and the pool's pods roll onto it"
                " (status.startupBudget.reason says why)."
            )
        return (
            text + ". That was a budget learned from observed starts, shorter than this start: the"
            " operator widens it (twice the window overrun, at most the formula's cold value) and after"
            " a second consecutive overrun falls back to the cold formula (docs/startup.md)."
        )
    if budget is not None and kill.window.seconds < budget.seconds:
        return (
            text + f". The pod's probe allows less than the operator's budget ({budget.seconds} s): the"
            " StatefulSet's startupProbe was changed outside the operator; a change of the LLMDeployment's"
            " spec puts the computed one back."
        )
    if budget is not None and budget.overridden:
        return (
            text + f". spec.startup.budgetSeconds ({budget.seconds} s) is shorter than this start: raise it,"
            " or remove it to use the computed budget (docs/startup.md)."
        )
    return (
        text + ". The computed budget is shorter than this start: give the JIT caches a persistent volume"
        " (spec.startup.jitCache.pvc) so restarts reuse compiled kernels, or raise"
        " spec.startup.budgetSeconds; status.pools.<pool>.observedStartupSeconds shows how long starts take."
    )


def oom_message(pod: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    container = str(status.get("name"))
    limit = _memory_limit(pod, container)
    field = POOL_FIELD.get(pod_component(pod) or "", "decode")
    where = f"pod {_name(pod)} container {container}"
    if limit is None:
        cause = "was OOM-killed with no memory limit of its own: the node ran out of memory"
    else:
        cause = f"was OOM-killed at its memory limit ({limit})"
    advice = f"raise spec.{field}.resources.limits.memory"
    if field != "router":
        advice += (
            " (or spec.runtime.resources.limits.memory for every pool), or make the runtime use less:"
            " a smaller KV cache (--kv-cache-gib) or batch (--max-num-seqs) in spec.runtime.args"
        )
    return f"{where} {cause}; {advice}."


def image_pull_message(pod: Mapping[str, Any], status: Mapping[str, Any], waiting: str) -> str:
    container = str(status.get("name"))
    spec = container_spec(pod, container)
    image = spec.get("image") or status.get("image") or "?"
    policy = spec.get("imagePullPolicy") or "IfNotPresent"
    node = (pod.get("spec") or {}).get("nodeName")
    on = f" on node {node}" if node else ""
    head = f"pod {_name(pod)} cannot get image {image}{on}"
    if waiting == "InvalidImageName":
        return f"{head}: it is not a valid image reference; correct spec.runtime.image."
    if waiting == "ErrImageNeverPull":
        return (
            f"{head}: imagePullPolicy is Never and the image is not on the node. Import it into the node's"
            " container runtime (on a cluster without a registry, e.g. ctr -n k8s.io images import), or"
            " set spec.runtime.imagePullPolicy to IfNotPresent with a registry that has it."
        )
    return (
        f"{head} (imagePullPolicy {policy}): the pull fails. On a cluster without a registry the image"
        " must be imported into each node's container runtime first (e.g. ctr -n k8s.io images import)."
        " Otherwise check the name and tag (spec.runtime.image, or the chart's runtimeImage), the"
        f" namespace's imagePullSecrets and that the node reaches the registry (kubectl describe pod"
        f" {_name(pod)} shows the registry's answer)."
    )


def crash_message(pod: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    container = str(status.get("name"))
    ended = (
        (status.get("lastState") or {}).get("terminated")
        or (status.get("state") or {}).get("terminated")
        or {}
    )
    code = ended.get("exitCode")
    text = f"pod {_name(pod)} container {container} keeps exiting"
    if code is not None:
        text += f" (exit code {code}" + (f", {ended['reason']}" if ended.get("reason") else "") + ")"
    line = _last_log_line(ended)
    if line:
        text += f"; its last log line: {line!r}"
    return (
        text
        + f"; the kubelet restarts it with a growing back-off. See kubectl logs {_name(pod)} -c {container} --previous."
    )


# ---- the problems of a set of pods ---------------------------------------------------------------


def _container_problem(
    pod: Mapping[str, Any],
    status: Mapping[str, Any],
    lives: Mapping[str, LifeMemory],
    budget: BudgetFacts | None,
) -> PodProblem | None:
    name = _name(pod)
    waiting = ((status.get("state") or {}).get("waiting") or {}).get("reason")
    if waiting in IMAGE_PULL_WAITING:
        return PodProblem(IMAGE_PULL_FAILED, image_pull_message(pod, status, waiting), name, 0)
    if waiting in CONTAINER_CONFIG_REASONS:
        detail = str(((status.get("state") or {}).get("waiting") or {}).get("message") or "").strip()
        message = f"pod {name} container {status.get('name')} cannot be created or run ({waiting})"
        message += (f": {detail}" if detail else "") + f"; see kubectl describe pod {name}."
        return PodProblem(waiting, message, name, 1)
    if started_and_ready(status):
        return None  # it serves: an earlier crash or kill is history (its Event says so)
    if oom_killed(status) is not None:
        return PodProblem(OOM_KILLED, oom_message(pod, status), name, 2)
    kill = startup_kill(pod, status, lives)
    if kill is not None:
        return PodProblem(STARTUP_PROBE_FAILED, startup_kill_message(kill, budget), name, 3)
    ended = (status.get("lastState") or {}).get("terminated")
    crashed_before = ended is not None and ended.get("exitCode") not in STOPPED_EXIT_CODES
    # Between two restarts the kubelet shows the container running: while it has not started again
    # after a crash it is still the same crash loop (one condition, not one flip per restart).
    if waiting == "CrashLoopBackOff" or (crashed_before and status.get("started") is not True):
        return PodProblem(CRASH_LOOP, crash_message(pod, status), name, 4)
    return None


def _placement_advice(detail: str) -> str:
    """What to look at for an unschedulable pod: its claims when the scheduler blames volumes
    (advice about GPUs would send a person the wrong way), else the pool's resources."""
    # "unbound immediate PersistentVolumeClaims", "volume node affinity conflict", "didn't find
    # available persistent volumes to bind", "max volume count": the scheduler's volume reasons.
    if "volume" in detail.lower():
        return (
            "Check the pod's claims (kubectl get pvc; kubectl describe pvc): one unbound, of a class"
            " that cannot provision it or its access mode, or a ReadWriteOnce volume on another node."
        )
    return (
        "Check that nodes offer the GPUs and RDMA devices the pool requests (kubectl describe pod),"
        " or lower the pool's resources."
    )


def pod_problems(
    pods: Iterable[Mapping[str, Any]],
    lives: Mapping[str, LifeMemory] | None = None,
    budget: BudgetFacts | None = None,
) -> list[PodProblem]:
    """Problems that need a person, most actionable first (then by pod name)."""
    lives = lives or {}
    problems = []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue  # going away: what it does now does not matter
        scheduled = pod_condition(pod, "PodScheduled") or {}
        if scheduled.get("reason") == "Unschedulable":
            detail = str(scheduled.get("message") or "").strip().rstrip(".")
            problems.append(
                PodProblem(
                    UNSCHEDULABLE,
                    f"pod {_name(pod)} cannot be scheduled: {detail}. {_placement_advice(detail)}",
                    _name(pod),
                    5,
                )
            )
        for status in container_statuses(pod):
            problem = _container_problem(pod, status, lives, budget)
            if problem is not None:
                problems.append(problem)
                break  # one problem per pod: its first container's
    return sorted(problems, key=lambda p: (p.rank, p.pod))


def readiness_failing(pods: Iterable[Mapping[str, Any]], now: float) -> list[PodProblem]:
    """Pods whose containers started but that have not been Ready for READINESS_GRACE_SECONDS: a
    readiness probe that never succeeds (a draining or terminating pod is not one)."""
    problems = []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        statuses = list(container_statuses(pod))
        ready = pod_condition(pod, "Ready") or {}
        since = parse_rfc3339(ready.get("lastTransitionTime"))
        if (
            not statuses
            or ready.get("status") != "False"
            or since is None
            or now - since < READINESS_GRACE_SECONDS
        ):
            continue
        if not all(s.get("started") is True for s in statuses):
            continue
        stuck = [s for s in statuses if s.get("ready") is not True]
        if not stuck:
            continue
        container = str(stuck[0].get("name"))
        path = ((container_spec(pod, container).get("readinessProbe") or {}).get("httpGet") or {}).get("path")
        probe = f"its readiness probe (GET {path})" if path else "its readiness probe"
        problems.append(
            PodProblem(
                READINESS_PROBE_FAILING,
                f"pod {_name(pod)} started but {probe} has failed since {ready.get('lastTransitionTime')}"
                f" (more than {READINESS_GRACE_SECONDS} s): it takes no requests. The runtime answers 503 there"
                " while it drains or while its output self-test fails (OutputHealthy); kubectl describe pod"
                f" {_name(pod)} shows the probe's answer.",
                _name(pod),
                6,
            )
        )
    return sorted(problems, key=lambda p: p.pod)


# ---- startup time --------------------------------------------------------------------------------


def observed_startup_seconds(pod: Mapping[str, Any]) -> int | None:
    """Seconds from the start of the pod's current containers to its latest turn to Ready, for a
    pod that is Ready now (None otherwise)."""
    start = observed_start(pod)
    return None if start is None else start[1]


def observed_start(pod: Mapping[str, Any]) -> tuple[str, int] | None:
    """(RFC 3339 start of the pod's current containers, seconds from then to its latest turn to
    Ready) for a pod that is Ready now; the start names the containers' life."""
    ready = pod_condition(pod, "Ready") or {}
    if ready.get("status") != "True" or pod["metadata"].get("deletionTimestamp"):
        return None
    became_ready = parse_rfc3339(ready.get("lastTransitionTime"))
    stamps = [
        ((s.get("state") or {}).get("running") or {}).get("startedAt")
        for s in (pod.get("status") or {}).get("containerStatuses") or ()
    ]
    starts = [(parse_rfc3339(stamp), stamp) for stamp in stamps]
    if became_ready is None or not starts or any(at is None for at, _ in starts):
        return None
    started, stamp = max((at, str(text)) for at, text in starts if at is not None)
    return (stamp, round(became_ready - started)) if became_ready >= started else None
