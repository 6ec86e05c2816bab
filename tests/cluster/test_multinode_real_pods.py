"""A multi-node replica whose pods really run: the tiny model with tensor parallelism 2 over two pods
of one LeaderWorkerSet group on the local cluster's real node (one rank per pod), the ranks meeting at
the leader's address that LeaderWorkerSet gives them (cluster DNS), the leader answering through the
router's Service. Needs the real node (issue 11) and LeaderWorkerSet (e2e/cluster/lws.sh)."""

from __future__ import annotations

import pytest
from cluster_helpers import Kubectl, OperatorHandle, llmd, port_forward, wait_ready
from openai import OpenAI
from sovereign_runtime.builtin.tasks import make_questions
from test_multinode_cluster import groups_ready
from test_real_pods import (
    READY_TIMEOUT,
    ask,
    assert_mostly_correct,
    endpoint_service,
    tiny_spec,
    wait_for_server,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_a_two_pod_tensor_parallel_group_of_the_tiny_model_serves_through_the_endpoint(
    kube: Kubectl, operator: OperatorHandle, real_pods_namespace: str, real_nodes: frozenset[str]
) -> None:
    if kube.get_or_none("crd", "leaderworkersets.leaderworkerset.x-k8s.io") is None:
        pytest.skip(
            "LeaderWorkerSet is not installed on this cluster (e2e/cluster/cluster.sh up installs it)"
        )
    ns, name = real_pods_namespace, "tiny-tp2"
    spec = tiny_spec()
    spec["decode"] = {"replicas": 1, "nodesPerReplica": 2, "nodeParallelism": "tensor"}
    kube.apply(llmd(name, spec), ns)
    # Two ranks load and meet before the leader reports ready: a slower start than one pod's.
    obj = wait_ready(kube, operator, ns, name, timeout=2 * READY_TIMEOUT)
    members = groups_ready(kube, ns, name, "unified", 1, 2)
    assert members is not None, "the group is not whole and Ready"
    assert {p["spec"]["nodeName"] for p in members} <= real_nodes
    for pod in members:
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "2", args
        assert args[args.index("--nnodes") + 1] == "2", args
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and status["restartCount"] == 0, status

    service, port = endpoint_service(obj)
    with port_forward(kube, ns, service, port) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
        wait_for_server(client)
        questions = make_questions(4, seed=23)
        answers = ask(client, obj["spec"]["model"]["name"], questions)
    # TP 2 is greedy-identical to one process (tests/runtime/test_tensor_parallel.py).
    assert_mostly_correct(questions, answers)
