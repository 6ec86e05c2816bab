"""`examples/tiny.yaml`, as a user applies it, answers chat completions with the built-in model.

On the local control plane kwok's pods run no containers, so once the LLMDeployment is Ready the test
runs the tiny pool's container here, with exactly the arguments the operator rendered into its
StatefulSet (only the listen address changes), as `make demo` does. On a cluster whose pods really
run (kind: `e2e/kind/up.sh test`) it asks through the router's Service, the endpoint in status. Both
ask questions whose answers can be checked, so a model that only produces text does not pass.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
from cluster_helpers import EXAMPLES, REPO, Kubectl, OperatorHandle, port_forward, wait_ready

pytestmark = pytest.mark.cluster

NAME = "tiny"
INSTANCE = "app.kubernetes.io/instance"


def demo_ask() -> ModuleType:
    """e2e/demo_ask.py, the demo's client (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("demo_ask", REPO / "e2e" / "demo_ask.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def pods_are_fake(kube: Kubectl, ns: str) -> bool:
    """Whether the LLMDeployment's pods sit on kwok's nodes (which run no containers)."""
    nodes = {p["spec"].get("nodeName") for p in kube.items("pods", "-n", ns, "-l", f"{INSTANCE}={NAME}")}
    assert nodes and None not in nodes, f"pods not scheduled: {nodes}"
    return all(
        kube.get("node", node)["metadata"].get("annotations", {}).get("kwok.x-k8s.io/node") == "fake"
        for node in nodes
    )


def test_tiny_example_answers_checkable_questions(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    kube.run("apply", "-n", namespace, "-f", str(EXAMPLES / "tiny.yaml"))
    # Real pods pull the runtime image and load the model; kwok's are Ready within seconds.
    obj = wait_ready(kube, operator, namespace, NAME, timeout=120 if kube.local else 900)
    model = obj["spec"]["model"]["name"]
    assert obj["status"]["endpoint"].startswith("http://"), obj["status"]

    client = demo_ask()
    if pods_are_fake(kube, namespace):
        sts = kube.get("statefulset", "-n", namespace, f"{NAME}-unified")
        rendered = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert client.served_model_name(rendered) == model, rendered
        log = REPO / ".cluster" / "test-logs" / f"{namespace}-tiny-runtime.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with client.serve_locally(rendered, log) as base:
            answers = client.ask(base, model)
    else:
        service = obj["status"]["endpoint"].removeprefix("http://").split(".")[0]
        port = int(obj["status"]["endpoint"].rsplit(":", 1)[-1].split("/")[0])
        with port_forward(kube, namespace, service, port) as base:
            client.wait_ready(base, timeout_s=120)
            answers = client.ask(base, model)

    # The built-in model scores about 99 % on these tasks; greedy answers are deterministic.
    correct = [a for a in answers if a.correct]
    assert len(correct) >= len(answers) - 1, answers
