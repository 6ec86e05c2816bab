"""Reconciling one LLMDeployment: render, apply, prune, and keep `status` true.

Free of kopf so tests drive it with a fake `Kube`; handlers.py feeds it from kopf's watches
through work queues (`sync` is the queue's entry, with its retries). Steady state makes zero
writes: children are applied only when their rendering changed (or one was deleted), and status
only when what it says changed. Every applied child carries the digest of its rendering
(cache.APPLIED_DIGEST), so a restarted operator that finds every child as it would render it
writes nothing either.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from sovereign_operator import metrics
from sovereign_operator.api.document import InvalidDeployment, check_name, parse_spec
from sovereign_operator.api.spec import LLMDeploymentSpec
from sovereign_operator.api.status import LLMDeploymentStatus, ModelStatus, StartupBudget
from sovereign_operator.cache import APPLIED_DIGEST
from sovereign_operator.gone import DeploymentGone, gone_error, is_gone
from sovereign_operator.kube import api_error_code
from sovereign_operator.modeldownload import JobView, assess, facts_from_status
from sovereign_operator.observe import Observed, Problem, compute_status, status_patch
from sovereign_operator.podstatus import LifeMemory
from sovereign_operator.render import ClusterFacts, DeploymentRef, Rendered, render
from sovereign_operator.render.modelcache import CONTAINER, ModelFacts, cache_objects
from sovereign_operator.render.plan import OperatorDefaults, sticky_plan, uses_groups, with_operator_defaults
from sovereign_operator.startupbudget import in_force, learn, previous_budget, previous_profiles
from sovereign_operator.vocabulary import LWS_CRD, now_rfc3339


class KubeApi(Protocol):
    async def apply(self, child: dict[str, Any]) -> None: ...
    async def apply_shared(self, child: dict[str, Any], owner_uid: str) -> None: ...
    async def release_shared(
        self, namespace: str, owner_uid: str, keep: set[tuple[str, str]]
    ) -> list[str]: ...
    async def release_unbound_claims(
        self, namespace: str, owner_uid: str | None, keep: set[tuple[str, str]]
    ) -> list[str]: ...
    async def observe_job(
        self, namespace: str, name: str, log_container: str | None, claim: str | None = None
    ) -> JobView: ...
    async def delete_job(self, namespace: str, name: str) -> None: ...
    def applied_digest(self, namespace: str, kind: str, name: str) -> str | None: ...
    async def prune(
        self, namespace: str, instance: str, owner_uid: str, keep: set[tuple[str, str]]
    ) -> list[str]: ...
    async def advertised_resources(self) -> frozenset[str]: ...
    async def leader_worker_set_installed(self) -> bool: ...
    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def observe(self, namespace: str, instance: str) -> Observed: ...
    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> None: ...


STATUS_CONFLICT_RETRIES = 3
# While a multi-node pool waits for LeaderWorkerSet to be installed, look again this often.
LWS_RETRY_SECONDS = 60.0
# Failed attempts in a row after which a transient apply failure is reported (status, Event).
REPORT_TRANSIENT_AFTER = 2
log = logging.getLogger(__name__)


class RetryLater(Exception):
    """A transient failure (apiserver unavailable, conflict, throttled): try again after `delay`."""

    def __init__(self, message: str, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


@dataclass
class Outcome:
    generation: int
    rendered: Rendered | None
    problem: Problem | None
    digest: str | None
    # A huggingFace source's download as last observed (status.model).
    model: ModelStatus | None = None


def replica_overrides(status: Mapping[str, Any] | None) -> dict[str, int]:
    """Replica counts the autoscaler decided, read from status (never from spec)."""
    overrides = {}
    for component, pool in ((status or {}).get("pools") or {}).items():
        decided = ((pool or {}).get("autoscaler") or {}).get("desiredReplicas")
        if isinstance(decided, int):
            overrides[component] = decided
    return overrides


def budget_in_force(rendered: Rendered, status: Mapping[str, Any] | None) -> StartupBudget:
    """The startup budget to render: decided from the observed starts status records, and kept as
    status says it was decided while the pods' template stays the same (startupbudget.py)."""
    learned = learn(previous_profiles(status), rendered.spec_key, rendered.formula)
    return in_force(
        rendered.formula, learned, rendered.spec_key, rendered.template_hash, previous_budget(status)
    )


# Deployments whose children are being applied at once (see Reconciler._apply_slots).
MAX_CONCURRENT_APPLIES = 8


# What the apiserver says to a write into a namespace being deleted.
NAMESPACE_TERMINATING = "because it is being terminated"


def backoff_seconds(retry: int) -> float:
    return float(min(300, 5 * 2 ** min(retry, 6)))


def _api_error_message(error: Exception) -> str:
    """The apiserver's own message (lightkube's Status.message), else the exception's text."""
    message = getattr(getattr(error, "status", None), "message", None)
    return message if isinstance(message, str) and message else str(error)


def apply_problem(code: int | None, child: str, message: str) -> tuple[Problem | None, bool]:
    """What a failed write of `child` (e.g. "StatefulSet/tiny-unified") means for the deployment:
    the problem a person must see (None for a transient error) and whether retrying can help."""
    lowered = message.lower()
    if code in (400, 422):
        # The same spec renders the same child: only a change of spec helps.
        return Problem("ApplyRejected", f"the apiserver rejected {child}: {message}"), False
    if code == 403 and "exceeded quota" in lowered:
        return Problem(
            "QuotaExceeded", f"{child} does not fit the namespace's ResourceQuota: {message}"
        ), True
    if code == 403 and "admission" in lowered:
        return Problem("AdmissionDenied", f"an admission check denied {child}: {message}"), True
    if code == 403:
        return Problem("Forbidden", f"the operator lacks RBAC permission for {child}: {message}"), True
    if code == 409:
        return Problem("Conflict", f"{child} conflicts with another writer: {message}"), True
    return None, True


def _child_key(ref: DeploymentRef, child: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (ref.namespace, ref.name, child["kind"], child["metadata"]["name"])


def _child_ref(child: Mapping[str, Any]) -> str:
    return f"{child.get('kind')}/{(child.get('metadata') or {}).get('name')}"


def _digest(children: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(children, sort_keys=True).encode()).hexdigest()


def with_applied_digest(child: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The child as applied: its rendering's digest in an annotation (metadata only, so a
    StatefulSet's pods do not roll), and the digest."""
    digest = _digest([child])[:32]
    meta = child["metadata"]
    annotated = {
        **child,
        "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), APPLIED_DIGEST: digest}},
    }
    return annotated, digest


class Reconciler:
    def __init__(
        self,
        kube: KubeApi,
        clock: Callable[[], str] = now_rfc3339,
        report_problem: Callable[[Mapping[str, Any], Problem], None] | None = None,
        defaults: OperatorDefaults | None = None,
        max_concurrent_applies: int = MAX_CONCURRENT_APPLIES,
        pod_memory: Callable[[str, str], Mapping[str, LifeMemory]] | None = None,
    ) -> None:
        self.kube = kube
        # What the startup monitor remembers of each container life (phases, started), for status.
        self.pod_memory = pod_memory or (lambda namespace, name: {})
        self.defaults = defaults or OperatorDefaults()
        self.clock = clock
        # Called for every problem a person must fix; the kopf adapter posts an Event.
        self.report_problem = report_problem or (lambda body, problem: None)
        self.outcomes: dict[tuple[str, str], Outcome] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # kopf runs one handler per object at once, so a burst of N new deployments would put N
        # apply loops on the apiserver together; past a few the apiserver answers 504 and every
        # loop retries with backoff. Bounded, a burst drains at the apiserver's own pace.
        self._apply_slots = asyncio.Semaphore(max_concurrent_applies)
        # Digest of each child as last applied: a retry after a partial failure (or a re-render
        # that changes one child) sends only what differs. A forced reconcile sends everything.
        # Keyed (namespace, deployment, kind, child name): forgetting one deployment touches no other's.
        self._applied: dict[tuple[str, str, str, str], str] = {}
        self._refresh_waiting: set[tuple[str, str]] = set()
        # The same for shared objects (model caches), per deployment: each applies its own owner reference.
        self._applied_shared: dict[tuple[str, str, str, str], str] = {}
        # Deployments whose status refresh found an overrun of the learned startup budget in force:
        # reconciled again at once (the overrunning pod keeps its probe until it is recreated).
        self._budget_overrun: dict[tuple[str, str], Mapping[str, Any]] = {}
        # Failed attempts in a row per deployment (the backoff of `sync`).
        self._retries: dict[tuple[str, str], int] = {}
        # Deployments whose namespace refused a write because it is being deleted, by uid: nothing
        # is reconciled for them again (their children's deletions would each try a write).
        self._ended: dict[tuple[str, str], str | None] = {}

    def _lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        for key in [k for k in self._applied_shared if k[:2] == (namespace, name)]:
            del self._applied_shared[key]
        self.outcomes.pop((namespace, name), None)
        self._locks.pop((namespace, name), None)
        self._budget_overrun.pop((namespace, name), None)
        self._retries.pop((namespace, name), None)
        for key in [k for k in self._applied if k[:2] == (namespace, name)]:
            del self._applied[key]

    def wants(self, body: Mapping[str, Any]) -> bool:
        """Whether a watch event of this LLMDeployment calls for a reconcile: a spec generation this
        process has not reconciled yet (a new object, a spec change, the first sight after a
        restart). Status writes, the operator's own included, do not."""
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return False
        key = (meta["namespace"], meta["name"])
        if self._ended_here(key, meta):
            return False
        outcome = self.outcomes.get(key)
        return (
            outcome is None or outcome.generation != int(meta.get("generation") or 1) or key in self._retries
        )

    def _ended_here(self, key: tuple[str, str], meta: Mapping[str, Any]) -> bool:
        """Found gone by a write (its namespace is being deleted) while its DELETED is on its way."""
        return key in self._ended and self._ended[key] == meta.get("uid")

    def deleted(self, namespace: str, name: str) -> None:
        """The LLMDeployment's DELETED arrived: forget it, and that it ended."""
        self.forget(namespace, name)
        self._ended.pop((namespace, name), None)

    def child_deleted(self, namespace: str, deployment: str, kind: str, name: str) -> None:
        """A child of `deployment` is gone (deleted by someone, or not found after a relist): the
        next reconcile applies it again."""
        self._applied.pop((namespace, deployment, kind, name), None)

    async def sync(self, namespace: str, name: str) -> float | None:
        """The work queue's entry: reconcile the deployment as the watch cache has it now, without
        the status refresh (the status queue does that). Returns the delay after which to try
        again, or None when done."""
        key = (namespace, name)
        body = await self.kube.get_deployment(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            if body is None:
                await self._release_after_deletion(namespace, name)
            return None
        if self._ended_here(key, body["metadata"]):
            return None
        try:
            await self.reconcile(body, retry=self._retries.get(key, 0), refresh=False)
        except DeploymentGone:
            return None  # deleted meanwhile: reconcile forgot it
        except RetryLater as error:
            self._retries[key] = self._retries.get(key, 0) + 1
            log.warning(
                "%s/%s: %s in %.0f s (attempt %d)", namespace, name, error, error.delay, self._retries[key]
            )
            return error.delay
        self._retries.pop(key, None)
        return None

    async def _release_after_deletion(self, namespace: str, name: str) -> None:
        """A deleted deployment's `Retain` cache claim that never bound goes too, unless another
        deployment applied it (kube.release_unbound_claims); a failure waits for the next
        reconcile of a huggingFace deployment in the namespace, which sweeps the same claims."""
        try:
            released = await self.kube.release_unbound_claims(namespace, None, set())
        except Exception as error:
            log.warning(
                "%s/%s deleted; releasing its unbound cache claims failed: %s", namespace, name, error
            )
            return
        if released:
            log.info("%s/%s deleted; released %s", namespace, name, ", ".join(released))

    async def reconcile(
        self, body: Mapping[str, Any], retry: int = 0, force: bool = False, refresh: bool = True
    ) -> Outcome:
        """Render and apply one LLMDeployment, then refresh its status (unless `refresh` is False:
        the caller has that done).

        Raises RetryLater for transient failures and DeploymentGone when the object no longer exists;
        an unrealisable spec becomes a Degraded status and a reported problem, not an exception, so
        nothing hot-loops.
        """
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        async with self._lock(key):
            started = time.monotonic()
            try:
                outcome = await self._reconcile_locked(body, key, retry, force)
            except RetryLater:
                # Still say what is wrong (e.g. Forbidden) before the retry.
                if refresh:
                    with contextlib.suppress(Exception):
                        await self._refresh_locked(key)
                raise
            finally:
                metrics.DURATION.observe(time.monotonic() - started)
            if not refresh:
                return outcome  # the status queue refreshes, and answers an overrun it finds
            await self._refresh_locked(key)
            return await self._answer_overrun_locked(key, outcome)

    async def _answer_overrun_locked(self, key: tuple[str, str], outcome: Outcome) -> Outcome:
        """Render again when the refresh just recorded an overrun of the learned budget in force (once:
        that render decides the widened budget or the fallback from what status now records)."""
        live = self._budget_overrun.pop(key, None)
        if live is None:
            return outcome
        outcome = await self._reconcile_locked(live, key, 0, False)
        await self._refresh_locked(key)
        self._budget_overrun.pop(key, None)
        return outcome

    async def _reconcile_locked(
        self, body: Mapping[str, Any], key: tuple[str, str], retry: int, force: bool
    ) -> Outcome:
        meta = body["metadata"]
        generation = int(meta.get("generation") or 1)
        ref = DeploymentRef(
            name=meta["name"], namespace=meta["namespace"], uid=meta["uid"], generation=generation
        )
        try:
            check_name(ref.name)
            spec = parse_spec(body.get("spec"))
            check_name(ref.name, spec)
        except InvalidDeployment as error:
            problem = Problem("InvalidSpec", str(error))
            self.report_problem(body, problem)
            metrics.RECONCILES.labels("invalid").inc()
            outcome = Outcome(generation, None, problem, None)
            self.outcomes[key] = outcome
            return outcome

        status = body.get("status")
        try:
            live = await self.kube.get_deployment(*key)
        except Exception as error:
            raise self._classify(error, "reading the deployment", retry) from error
        if is_gone(body, live):
            # Deleted, or its namespace is (a stale body from the cache): nothing to apply, and
            # nothing of it to keep. Applying would only be refused ("namespace not found").
            self.forget(*key)
            raise gone_error(body)
        assert live is not None
        if int(live["metadata"].get("generation") or 1) == generation:
            # The body can predate the autoscaler's latest decision; rendering from it would put an
            # old replica count back on the StatefulSets until the next tick.
            status = live.get("status") or status
        if uses_groups(spec):
            try:
                installed = await self.kube.leader_worker_set_installed()
            except Exception as error:
                raise self._classify(error, "reading the LeaderWorkerSet CRD", retry) from error
            if not installed:
                # No StatefulSet fallback: a group must start, restart and scale as one (docs/api.md).
                problem = Problem(
                    "LeaderWorkerSetNotInstalled",
                    f"a pool with nodesPerReplica above 1 is rendered as a LeaderWorkerSet ({LWS_CRD}),"
                    " whose CRD this cluster does not have: install LeaderWorkerSet (docs/install.md) or"
                    f" set nodesPerReplica to 1; checking again every {LWS_RETRY_SECONDS:.0f} s",
                )
                self.report_problem(body, problem)
                metrics.RECONCILES.labels("invalid").inc()
                self.outcomes[key] = Outcome(generation, None, problem, None)
                raise RetryLater(problem.message, LWS_RETRY_SECONDS)
        decided = sticky_plan(status, generation)
        facts = ClusterFacts()
        if decided is None:
            try:
                facts = ClusterFacts(await self.kube.advertised_resources())
            except Exception as error:
                raise self._classify(error, "listing nodes", retry) from error
        model_facts, model_status, shared_missing = None, None, False
        if spec.model.source.hugging_face is not None:
            try:
                model_facts, model_status, shared_missing = await self._assess_model(ref, spec, status)
            except Exception as error:
                raise self._classify(error, "reading the model download Jobs", retry) from error
        overrides = replica_overrides(status)
        rendered = render(ref, spec, facts, overrides, decided, self.defaults, model=model_facts)
        budget = budget_in_force(rendered, status)
        if budget != rendered.budget:
            rendered = render(
                ref, spec, facts, overrides, decided, self.defaults, model=model_facts, budget=budget
            )
        digest = _digest(rendered.children + rendered.shared + [sorted(rendered.keep_shared)])
        children = [with_applied_digest(child) for child in rendered.children]
        previous = self.outcomes.get(key)
        if shared_missing:
            # A Job this deployment applied is gone (deleted to retry, or its TTL), or the claim
            # its download fills (deleted by hand, or by another deployment's release): apply again.
            for shared_key in [k for k in self._applied_shared if k[:2] == (ref.namespace, ref.name)]:
                del self._applied_shared[shared_key]
        elif (
            not force
            and previous is not None
            and previous.digest == digest
            and previous.problem is None
            and all(self._applied.get(_child_key(ref, c)) == d for c, d in children)
        ):
            metrics.RECONCILES.labels("unchanged").inc()
            if previous.generation == generation:
                previous.model = model_status  # progress moves while the children stay the same
                return previous
            # A spec change that renders the same children (a field set to its default, say) is
            # still this generation's outcome: status reports it observed, and the status refresh,
            # which waits for the outcome of the live generation, goes on.
            outcome = replace(previous, generation=generation, rendered=rendered, model=model_status)
            self.outcomes[key] = outcome
            return outcome

        writing = "the children"
        written = 0
        try:
            async with self._apply_slots:
                for child, child_digest in children:
                    writing = _child_ref(child)
                    child_key = _child_key(ref, child)
                    if not force and child_digest in (
                        self._applied.get(child_key),
                        # Live, as last applied: after a restart, or applied by an earlier attempt.
                        self.kube.applied_digest(ref.namespace, child["kind"], child["metadata"]["name"]),
                    ):
                        self._applied[child_key] = child_digest
                        continue
                    self._applied.pop(child_key, None)
                    await self.kube.apply(child)
                    written += 1
                    self._applied[child_key] = child_digest
                    metrics.CHILDREN_APPLIED.labels(child["kind"]).inc()
                for child in rendered.shared:
                    writing = _child_ref(child)
                    shared_key = (ref.namespace, ref.name, child["kind"], child["metadata"]["name"])
                    child_digest = _digest([child])
                    if not force and self._applied_shared.get(shared_key) == child_digest:
                        continue
                    self._applied_shared.pop(shared_key, None)
                    await self.kube.apply_shared(child, ref.uid)
                    self._applied_shared[shared_key] = child_digest
                    metrics.CHILDREN_APPLIED.labels(child["kind"]).inc()
                writing = "children of an earlier mode (prune)"
                keep = {(c["kind"], c["metadata"]["name"]) for c in rendered.children}
                written += len(await self.kube.prune(ref.namespace, ref.name, ref.uid, keep))
                if rendered.shared or (status or {}).get("model"):
                    # A huggingFace source now or before: drop the caches it stopped using.
                    writing = "model caches no longer used (release)"
                    in_use = {(c["kind"], c["metadata"]["name"]) for c in rendered.shared}
                    released = await self.kube.release_shared(
                        ref.namespace, ref.uid, in_use | set(rendered.keep_shared)
                    )
                    written += len(released)
                    for gone in released:
                        kind, _, name = gone.partition("/")
                        self._applied_shared.pop((ref.namespace, ref.name, kind, name), None)
        except Exception as error:
            message = _api_error_message(error)
            if api_error_code(error) == 403 and NAMESPACE_TERMINATING in message:
                # The namespace is going and the deployment with it: no retries, no Events.
                self.forget(*key)
                self._ended[key] = meta.get("uid")
                raise gone_error(body) from error
            problem, retryable = apply_problem(api_error_code(error), writing, message)
            if problem is None and retry >= REPORT_TRANSIENT_AFTER:
                # Transient by its status code, yet it keeps failing (a full Service IP range answers
                # 500 every time): a person must see it, not only the retries.
                problem = Problem(
                    "ApplyFailing",
                    f"applying {writing} failed {retry + 1} times in a row: {message}; retrying",
                )
            if problem is not None:
                # Named in status and an Event; other deployments keep reconciling meanwhile.
                self.report_problem(body, problem)
                self.outcomes[key] = Outcome(generation, rendered, problem, None, model_status)
            if not retryable:
                metrics.RECONCILES.labels("failed").inc()
                return self.outcomes[key]
            raise self._classify(error, f"applying {writing}", retry) from error

        metrics.RECONCILES.labels("applied" if written else "unchanged").inc()
        outcome = Outcome(generation, rendered, None, digest, model_status)
        self.outcomes[key] = outcome
        return outcome

    async def _assess_model(
        self, ref: DeploymentRef, spec: LLMDeploymentSpec, status: Mapping[str, Any] | None
    ) -> tuple[ModelFacts, ModelStatus, bool]:
        """What the huggingFace source's Jobs say: the facts rendering needs, status.model, and
        whether the Job being watched, or the claim being filled, is missing (never applied, or
        deleted since)."""
        source = spec.model.source.hugging_face
        assert source is not None
        previous = (status or {}).get("model")
        endpoint = self.defaults.hf_endpoint
        known = facts_from_status(source, endpoint, previous)
        # Rendered from the spec with the operator's defaults, as render() does: same Job names.
        defaulted = with_operator_defaults(spec, self.defaults)
        objects = cache_objects(ref.name, ref.uid, ref.namespace, defaulted, endpoint, known)
        downloading = objects.download_job is not None
        container = CONTAINER if downloading else None
        claim = objects.cache_name if downloading else None
        view = await self.kube.observe_job(ref.namespace, objects.watched_job, container, claim)
        assessment = assess(source, endpoint, previous, known, objects, view)
        if assessment.status.reason == "NoResult":
            # Its answer is lost with its pod: delete it so the next apply runs it again.
            await self.kube.delete_job(ref.namespace, objects.watched_job)
        return (
            assessment.facts,
            assessment.status,
            view.job is None or (claim is not None and view.claim is None),
        )

    def _classify(self, error: Exception, doing: str, retry: int) -> RetryLater:
        code = api_error_code(error)
        metrics.ERRORS.labels(f"http_{code}" if code else type(error).__name__).inc()
        return RetryLater(f"{doing} failed ({error}); retrying", backoff_seconds(retry))

    async def refresh_status(self, namespace: str, name: str) -> bool:
        """Recompute status from the children; True when a patch was written.

        Coalesced: while one refresh of a deployment waits for its lock, later ones return at once,
        because the waiting one has not read the children yet and will see what they changed. A
        burst of pod events then costs one read of the children, not one per event."""
        key = (namespace, name)
        if key in self._refresh_waiting:
            return False
        self._refresh_waiting.add(key)
        try:
            async with self._lock(key):
                self._refresh_waiting.discard(key)
                wrote = await self._refresh_locked(key)
                if key in self._budget_overrun and key in self.outcomes:
                    await self._answer_overrun_locked(key, self.outcomes[key])
                return wrote
        finally:
            self._refresh_waiting.discard(key)

    async def _refresh_locked(self, key: tuple[str, str]) -> bool:
        # The autoscaler writes the same status; a write carries the resourceVersion it was
        # computed from, and a conflict means: read again and recompute.
        for _ in range(STATUS_CONFLICT_RETRIES):
            try:
                return await self._refresh_once(key)
            except Exception as error:
                if api_error_code(error) != 409:
                    raise
        return False

    async def _refresh_once(self, key: tuple[str, str]) -> bool:
        outcome = self.outcomes.get(key)
        if outcome is None:
            return False  # not reconciled yet; the create/resume handler will do it
        live = await self.kube.get_deployment(*key)
        if live is None:
            self.forget(*key)
            return False
        generation = int(live["metadata"].get("generation") or 1)
        if generation != outcome.generation:
            return False  # a newer spec is on its way through reconcile
        current = live.get("status") or {}
        observed = await self.kube.observe(*key) if outcome.rendered is not None else Observed()
        observed = replace(observed, lives=self.pod_memory(*key))
        try:
            previous = LLMDeploymentStatus.model_validate(current)
        except ValueError:
            previous = None
        desired = compute_status(
            generation, outcome.rendered, observed, previous, self.clock(), outcome.problem, outcome.model
        )
        rendered = outcome.rendered
        if rendered is not None and desired.startup_observations is not None:
            learned = learn(desired.startup_observations.profiles, rendered.spec_key, rendered.formula)
            decided = in_force(
                rendered.formula, learned, rendered.spec_key, rendered.template_hash, rendered.budget
            )
            if decided != rendered.budget:
                self._budget_overrun[key] = live
        patch = status_patch(current, desired)
        if patch is None:
            return False
        await self.kube.patch_status(
            key[0], key[1], patch, resource_version=live["metadata"].get("resourceVersion")
        )
        metrics.STATUS_WRITES.inc()
        return True
