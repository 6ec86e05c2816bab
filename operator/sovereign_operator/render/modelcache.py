"""Rendering a `huggingFace` model source: the resolve Job, the cache claim and its download Job.

A download goes in two steps because the claim is sized from the repo's file list and named after
the commit: first a resolve Job (no volume) asks the hub what the revision is now and which files
the patterns select, and leaves the answer in its termination message; then the cache claim and a
download Job filling it by commit. The pools mount the claim read-only once that Job completed.

Caches and their Jobs are shared: every LLMDeployment of the namespace that names the same repo,
commit, patterns and cache settings renders the same claim, and each applies it under its own field
manager with its own (non-controller) owner reference, so Kubernetes' garbage collector removes a
`retention: Delete` cache with the last of them. A `Retain` claim carries no owner reference and
stays. Names are digests of what the object holds, so two different objects never share a name
and an immutable Job spec never needs changing in place.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from sovereign_operator.api.crd import API_VERSION, KIND
from sovereign_operator.api.spec import HuggingFaceSource, LLMDeploymentSpec
from sovereign_operator.vocabulary import APP_NAME, COMPONENT_LABEL, MANAGED_BY, MANAGED_BY_LABEL, NAME_LABEL

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
CACHE_LABEL = "sovereign.ai/model-cache"
RESOLVE_COMPONENT = "model-resolve"
DOWNLOAD_COMPONENT = "model-download"
CACHE_COMPONENT = "model-cache"
SHARED_COMPONENTS = (RESOLVE_COMPONENT, DOWNLOAD_COMPONENT, CACHE_COMPONENT)
CACHE_MOUNT = "/cache"
# The download command's layout (runtime/sovereign_runtime/modelhub): the files live in checkpoint/.
CHECKPOINT_SUBDIR = "checkpoint"
CONTAINER = "download"
# A failing container restarts in its pod with the kubelet's backoff (10 s doubling to 5 min):
# about 8 hours of tries before the Job gives up, long enough to outlast a hub outage or a fix.
BACKOFF_LIMIT = 100
# The resolve Job's answer is read within seconds; the TTL only clears Jobs nobody released.
RESOLVE_TTL_SECONDS = 3600
DOWNLOAD_RESOURCES = {"limits": {"memory": "4Gi"}, "requests": {"cpu": "1", "memory": "1Gi"}}
RUNTIME_UID = 65532  # the runtime image's user (images/runtime.Dockerfile)
SLUG_LENGTH = 36


@dataclass(frozen=True)
class Resolved:
    """What the resolve Job found: the commit and the size of the selected files."""

    commit: str
    bytes_total: int
    files: int


@dataclass(frozen=True)
class Serving:
    """The complete cache the pools read."""

    commit: str
    cache: str
    bytes_total: int


@dataclass(frozen=True)
class ModelFacts:
    """What the cluster has said about a huggingFace source so far (from status and the Jobs)."""

    resolved: Resolved | None = None
    complete: bool = False
    serving: Serving | None = None


@dataclass(frozen=True)
class CacheObjects:
    """The shared objects of one source in its current state, and which Job to watch."""

    source_hash: str
    resolve_job: dict[str, Any] | None
    cache: dict[str, Any] | None
    download_job: dict[str, Any] | None

    @property
    def shared(self) -> list[dict[str, Any]]:
        return [o for o in (self.resolve_job, self.cache, self.download_job) if o is not None]

    @property
    def watched_job(self) -> str:
        job = self.download_job or self.resolve_job
        assert job is not None
        return str(job["metadata"]["name"])

    @property
    def cache_name(self) -> str | None:
        return None if self.cache is None else str(self.cache["metadata"]["name"])


def _digest(value: Any, length: int) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:length]


def slug(repo: str) -> str:
    """The repo id as a DNS label fragment: deepseek-ai/DeepSeek-V3 -> deepseek-ai-deepseek-v3."""
    text = re.sub(r"[^a-z0-9]+", "-", repo.lower()).strip("-")
    return text[:SLUG_LENGTH].rstrip("-") or "model"


def endpoint_of(source: HuggingFaceSource, default_endpoint: str) -> str:
    return (source.endpoint or default_endpoint or DEFAULT_HF_ENDPOINT).rstrip("/")


def source_hash(source: HuggingFaceSource, default_endpoint: str) -> str:
    """What a resolution depends on: a change to any of it resolves again."""
    token = source.token_secret_ref
    return _digest(
        {
            "endpoint": endpoint_of(source, default_endpoint),
            "repo": source.repo,
            "revision": source.revision,
            "allow": source.allow_patterns,
            "ignore": source.ignore_patterns,
            "token": None if token is None else [token.name, token.key],
        },
        16,
    )


def cache_size(bytes_total: int, override: int | str | None) -> int | str:
    """The claim's capacity: the override, else the files + 5% + 1 GiB, in whole GiB."""
    if override is not None:
        return override
    return f"{math.ceil(bytes_total * 1.05 / 2**30) + 1}Gi"


def _labels(component: str, cache: str | None = None) -> dict[str, str]:
    labels = {COMPONENT_LABEL: component, MANAGED_BY_LABEL: MANAGED_BY, NAME_LABEL: APP_NAME}
    if cache is not None:
        labels[CACHE_LABEL] = cache
    return dict(sorted(labels.items()))


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """A shared object names each LLMDeployment using it; none of them controls it."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": False,
        "blockOwnerDeletion": False,
    }


def _annotations(source: HuggingFaceSource, commit: str | None) -> dict[str, str]:
    notes = {"sovereign.ai/repo": source.repo, "sovereign.ai/revision": source.revision}
    if commit is not None:
        notes["sovereign.ai/commit"] = commit
    return dict(sorted(notes.items()))


def _download_args(source: HuggingFaceSource, revision: str, endpoint: str) -> list[str]:
    args = ["download", "--repo", source.repo, "--revision", revision, "--endpoint", endpoint]
    for pattern in source.allow_patterns:
        args += ["--allow-pattern", pattern]
    for pattern in source.ignore_patterns:
        args += ["--ignore-pattern", pattern]
    return args


def _job_pod(
    spec: LLMDeploymentSpec,
    source: HuggingFaceSource,
    args: list[str],
    labels: dict[str, str],
    cache: str | None,
) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        # The library's own caches and lock files, on the writable scratch volume.
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if source.token_secret_ref is not None:
        ref = source.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    if cache is not None:
        mounts.append({"name": "cache", "mountPath": CACHE_MOUNT})
        volumes.append({"name": "cache", "persistentVolumeClaim": {"claimName": cache}})
    return {
        "metadata": {"labels": labels},
        "spec": {
            "restartPolicy": "OnFailure",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            # fsGroup makes the claim writable to the image's non-root user.
            "securityContext": {
                "fsGroup": RUNTIME_UID,
                "fsGroupChangePolicy": "OnRootMismatch",
                "runAsNonRoot": True,
                "runAsUser": RUNTIME_UID,
                "runAsGroup": RUNTIME_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": CONTAINER,
                    "image": spec.runtime.image,
                    "imagePullPolicy": spec.runtime.image_pull_policy,
                    "command": ["sovereign-runtime"],
                    "args": args,
                    "env": env,
                    "resources": DOWNLOAD_RESOURCES,
                    "volumeMounts": mounts,
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": True,
                    },
                    # The result (commit, sizes, or the failure with the hub's message) for the operator.
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                }
            ],
            "volumes": volumes,
        },
    }


def _metadata(
    name: str, namespace: str, labels: dict[str, str], notes: dict[str, str], owners: list[Any]
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels, "annotations": notes}
    if owners:
        meta["ownerReferences"] = owners
    return meta


def resolve_job(
    owner: str, uid: str, namespace: str, spec: LLMDeploymentSpec, source: HuggingFaceSource, endpoint: str
) -> dict[str, Any]:
    args = [*_download_args(source, source.revision, endpoint), "--resolve-only"]
    job_spec = {
        "backoffLimit": BACKOFF_LIMIT,
        "ttlSecondsAfterFinished": RESOLVE_TTL_SECONDS,
        "template": _job_pod(spec, source, args, _labels(RESOLVE_COMPONENT), None),
    }
    name = f"hf-resolve-{slug(source.repo)}-{_digest(job_spec, 10)}"
    meta = _metadata(
        name, namespace, _labels(RESOLVE_COMPONENT), _annotations(source, None), [owner_reference(owner, uid)]
    )
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


def cache_claim_name(source: HuggingFaceSource, commit: str) -> str:
    cache = source.cache
    key = {
        "repo": source.repo,
        "commit": commit,
        "allow": source.allow_patterns,
        "ignore": source.ignore_patterns,
        "storageClassName": cache.storage_class_name,
        "size": cache.size,
        "accessMode": cache.access_mode,
        "retention": cache.retention,
    }
    return f"hf-{slug(source.repo)}-{_digest(key, 10)}"


def cache_claim(
    owner: str, uid: str, namespace: str, source: HuggingFaceSource, resolved: Resolved
) -> dict[str, Any]:
    name = cache_claim_name(source, resolved.commit)
    cache = source.cache
    claim_spec: dict[str, Any] = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": cache_size(resolved.bytes_total, cache.size)}},
        "volumeMode": "Filesystem",
    }
    if cache.storage_class_name is not None:
        claim_spec["storageClassName"] = cache.storage_class_name
    owners = [owner_reference(owner, uid)] if cache.retention == "Delete" else []
    meta = _metadata(
        name, namespace, _labels(CACHE_COMPONENT, name), _annotations(source, resolved.commit), owners
    )
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim_spec}


def download_job(
    owner: str,
    uid: str,
    namespace: str,
    spec: LLMDeploymentSpec,
    source: HuggingFaceSource,
    endpoint: str,
    resolved: Resolved,
    cache: str,
) -> dict[str, Any]:
    args = [*_download_args(source, resolved.commit, endpoint), "--dest", CACHE_MOUNT]
    job_spec = {
        "backoffLimit": BACKOFF_LIMIT,
        "template": _job_pod(spec, source, args, _labels(DOWNLOAD_COMPONENT, cache), cache),
    }
    name = f"{cache}-{_digest(job_spec, 5)}"
    meta = _metadata(
        name,
        namespace,
        _labels(DOWNLOAD_COMPONENT, cache),
        _annotations(source, resolved.commit),
        [owner_reference(owner, uid)],
    )
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


def cache_objects(
    owner: str, uid: str, namespace: str, spec: LLMDeploymentSpec, default_endpoint: str, facts: ModelFacts
) -> CacheObjects:
    """The shared objects this LLMDeployment renders for its huggingFace source: the resolve Job until
    the commit is known, then the cache claim and its download Job."""
    source = spec.model.source.hugging_face
    assert source is not None
    endpoint = endpoint_of(source, default_endpoint)
    digest = source_hash(source, default_endpoint)
    if facts.resolved is None:
        return CacheObjects(digest, resolve_job(owner, uid, namespace, spec, source, endpoint), None, None)
    claim = cache_claim(owner, uid, namespace, source, facts.resolved)
    name = claim["metadata"]["name"]
    job = download_job(owner, uid, namespace, spec, source, endpoint, facts.resolved, name)
    return CacheObjects(digest, None, claim, job)
