"""Pure rendering of a multi-node pool (``nodesPerReplica`` > 1): one LeaderWorkerSet, each replica a group.

A group is ``nodesPerReplica`` pods: the leader (worker index 0) runs rank 0, serves the API and metrics and
takes the pool's traffic (the pool's Service selects leaders only); the workers run the other ranks and
answer only their probes. Every member gets the same container (GPUs, RDMA devices, volumes) and the
same ``serve`` flags plus the group's: ``--nnodes``, the split over nodes (``--pipeline-parallel-size``, or
a ``--tensor-parallel-size`` over all the group's GPUs) and a ``--rendezvous-timeout`` as long as the
startup budget; each pod's node rank and the leader's address come from LeaderWorkerSet's environment.

The group is one unit: LeaderWorkerSet's RecreateGroupOnPodRestart restarts every member when one
restarts (a rank cannot rejoin a running group), the scale subresource and rolling updates move whole
groups, and members prefer nodes of one network domain (the topology labels below, when nodes have them).
"""

from __future__ import annotations

import copy
from typing import Any

from sovereign_operator.api.spec import LLMDeploymentSpec, PoolSpec
from sovereign_operator.api.status import StartupBudget
from sovereign_operator.vocabulary import (
    LWS_GROUP,
    LWS_GROUP_KEY_LABEL,
    LWS_KIND,
    LWS_VERSION,
    LWS_WORKER_INDEX_LABEL,
)

# The group's wait for its ranks, as long as the startup budget (so it changes with a learned budget).
RENDEZVOUS_TIMEOUT_FLAG = "--rendezvous-timeout"

# Network locality labels, nearest first, and how much a group prefers to share each (NVIDIA's topograph
# writes the network.topology.nvidia.com ones; older releases say block where newer say leaf).
TOPOLOGY_PREFERENCES = (
    ("network.topology.nvidia.com/accelerator", 100),  # one NVLink domain
    ("network.topology.nvidia.com/leaf", 80),  # one top-of-rack switch
    ("network.topology.nvidia.com/block", 80),
    ("network.topology.nvidia.com/spine", 50),
    ("topology.kubernetes.io/zone", 10),
)


def group_flags(spec: LLMDeploymentSpec, pool: PoolSpec, budget: StartupBudget) -> dict[str, str]:
    """The ``serve`` flags a group adds (or, for the tensor-parallel size, changes)."""
    nodes = pool.nodes_per_replica
    if (pool.node_parallelism or "pipeline") == "pipeline":
        flags = {"--pipeline-parallel-size": str(nodes)}
    else:
        flags = {"--tensor-parallel-size": str(spec.runtime.tensor_parallel_size * nodes)}
    return {**flags, "--nnodes": str(nodes), RENDEZVOUS_TIMEOUT_FLAG: str(budget.seconds)}


def _with_flags(args: list[str], flags: dict[str, str]) -> list[str]:
    out = list(args)
    # New flags go after --tensor-parallel-size, before the user's own runtime.args (kept last).
    at = out.index("--tensor-parallel-size") + 2
    for flag, value in flags.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out[at:at] = [flag, value]
            at += 2
    return out


def _topology_affinity(labels: dict[str, str], affinity: dict[str, Any] | None) -> dict[str, Any]:
    """Members of one group prefer nodes sharing each topology label (the pool's own podAffinity wins)."""
    affinity = copy.deepcopy(affinity) if affinity else {}
    if "podAffinity" in affinity:
        return affinity
    affinity["podAffinity"] = {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": weight,
                "podAffinityTerm": {
                    "labelSelector": {"matchLabels": dict(labels)},
                    # The group's own members: LeaderWorkerSet's per-group key, read off each new pod.
                    "matchLabelKeys": [LWS_GROUP_KEY_LABEL],
                    "topologyKey": key,
                },
            }
            for key, weight in TOPOLOGY_PREFERENCES
        ]
    }
    return affinity


def leader_worker_set(
    metadata: dict[str, Any],
    spec: LLMDeploymentSpec,
    pool: PoolSpec,
    replicas: int,
    budget: StartupBudget,
    template: dict[str, Any],
    selector: dict[str, str],
) -> dict[str, Any]:
    """The pool's LeaderWorkerSet from the pool's pod ``template`` (a StatefulSet's, rendered as usual)."""
    flags = group_flags(spec, pool, budget)
    leader = copy.deepcopy(template)
    leader_container = leader["spec"]["containers"][0]
    leader_container["args"] = _with_flags(leader_container["args"], flags)
    leader["spec"]["affinity"] = _topology_affinity(selector, leader["spec"].get("affinity"))

    worker = copy.deepcopy(leader)
    worker_container = worker["spec"]["containers"][0]
    # A worker serves no API: no drain hook (it leaves when the leader, after its drain, stops the group;
    # it ignores SIGTERM until then) and no KV port (the leader receives the KV and hands it on).
    worker_container.pop("lifecycle", None)
    worker_container["ports"] = [p for p in worker_container["ports"] if p["name"] == "http"]
    return {
        "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
        "kind": LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            # Workers' pods are created with the leader's: every rank loads at the same time.
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": pool.nodes_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def leader_selector(selector: dict[str, str]) -> dict[str, str]:
    """The pool Service's selector for a multi-node pool: its groups' leaders only."""
    return {**selector, LWS_WORKER_INDEX_LABEL: "0"}
