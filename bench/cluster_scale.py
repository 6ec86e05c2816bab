"""Apply N LLMDeployments at once to the local control plane and time the operator against the
limit the apiserver allows, measured in the same run.

Reports, per N: time from the apply until every child of each LLMDeployment is applied (p50/p99,
from the apiserver's audit log: the first successful write of each child), until each is Ready
(p50/p99, and the last one), the operator's peak RSS, its API requests, and its writes per minute
in the steady state afterwards (target zero). The limit: the same children, rendered beforehand,
applied by a plain concurrent server-side-apply client (8 workers, persistent connections, the
operator's own identity) to N LLMDeployments nobody else reconciles; the ratio operator / limit is
the figure that survives this shared machine's noise.

    .venv/bin/python bench/cluster_scale.py --counts 10 100

It starts the local cluster if needed (e2e/cluster/cluster.sh up) and runs the operator as a
subprocess with the chart's RBAC, exactly as tests/cluster does. The deployments use the built-in
CPU model (unified mode: one worker StatefulSet and a router each), so 100 fit on the fake nodes; their
namespaces send every pod there (`create_namespace(..., fake_nodes=True)`), never to the real node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from cluster_helpers import (  # noqa: E402 - the helpers live with the cluster tests
    CLUSTER_SH,
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    Kubectl,
    OperatorProcess,
    audit_log_path,
    audited_writes,
    condition,
    create_namespace,
    local_kubeconfig,
    make_operator_kubeconfig,
)
from lightkube import AsyncClient, KubeConfig, codecs  # noqa: E402
from sovereign_operator.api.document import parse_document  # noqa: E402
from sovereign_operator.kube import FIELD_MANAGER  # noqa: E402
from sovereign_operator.render import DeploymentRef, render  # noqa: E402

OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"


def llmd(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "sovereign.ai/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": "tiny", "source": {"builtin": "sovereign-tiny"}}, "mode": "unified"},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


CHILD_RESOURCES = {
    "statefulsets",
    "deployments",
    "services",
    "poddisruptionbudgets",
    "configmaps",
    "serviceaccounts",
    "roles",
    "rolebindings",
}


def children_applied(audit: Path, user: str, ns: str, since: float) -> dict[str, float]:
    """Per LLMDeployment (by its name prefix), wall-clock time of the first successful write of
    its last child to be written: when all its children existed."""
    first: dict[str, float] = {}
    for event in audited_writes(audit, user, since):
        ref = event.get("objectRef") or {}
        code = (event.get("responseStatus") or {}).get("code", 0)
        if ref.get("namespace") != ns or ref.get("resource") not in CHILD_RESOURCES or not 200 <= code < 300:
            continue
        key = f"{ref['resource']}/{ref['name']}"
        at = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
        first[key] = min(at, first.get(key, at))
    done: dict[str, float] = {}
    for key, at in first.items():
        instance = key.split("/", 1)[1].split("-", 1)[0]
        done[instance] = max(at, done.get(instance, at))
    return done


def requests_made(audit: Path, user: str, since: float) -> int:
    return len(audited_writes(audit, user, since))


async def apply_all(kubeconfig: Path, per_deployment: list[list[dict[str, Any]]], workers: int) -> None:
    """The limit: a plain SSA client with `workers` deployments in flight over persistent
    connections, each deployment's children in render order (a RoleBinding needs its Role)."""
    client = AsyncClient(KubeConfig.from_file(str(kubeconfig)), field_manager=FIELD_MANAGER)
    queue: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
    for children in per_deployment:
        queue.put_nowait(children)

    async def worker() -> None:
        while not queue.empty():
            for child in queue.get_nowait():
                await client.apply(codecs.from_dict(child), field_manager=FIELD_MANAGER, force=True)

    try:
        await asyncio.gather(*(worker() for _ in range(workers)))
    finally:
        await client.close()


def run_limit(kube: Kubectl, operator_kubeconfig: Path, count: int, workers: int) -> dict[str, Any]:
    """The same children applied without the operator (nobody watches this namespace)."""
    ns = f"limit-{count}-{int(time.time())}"
    create_namespace(kube, ns, fake_nodes=True)
    names = [f"m{i:03d}" for i in range(count)]
    kube.apply({"apiVersion": "v1", "kind": "List", "items": [llmd(n) for n in names]}, ns)
    children: list[list[dict[str, Any]]] = []
    for obj in kube.items("llmd", "-n", ns):
        parsed = parse_document(obj)
        ref = DeploymentRef(
            name=parsed.name, namespace=ns, uid=obj["metadata"]["uid"], generation=parsed.generation
        )
        children.append(render(ref, parsed.spec).children)
    audit = audit_log_path(kube)
    assert audit is not None, "the local control plane keeps an audit log"
    since = time.time()
    asyncio.run(apply_all(operator_kubeconfig, children, workers))
    elapsed = time.time() - since
    time.sleep(2)  # the audit log is written asynchronously
    done = [at - since for at in children_applied(audit, OPERATOR_USER, ns, since).values()]
    kube.run("delete", "namespace", ns, "--wait=true", "--timeout=300s", timeout=330)
    assert len(done) == count, f"the limit run applied children of {len(done)}/{count} deployments"
    return {
        "limit_children": sum(len(c) for c in children),
        "limit_total_s": round(elapsed, 2),
        "limit_children_p50_s": round(statistics.median(done), 2),
        "limit_children_p99_s": round(percentile(done, 0.99), 2),
    }


def run_one(
    kube: Kubectl, operator_kubeconfig: Path, count: int, steady_s: float, log_dir: Path
) -> dict[str, Any]:
    ns = f"bench-{count}-{int(time.time())}"
    create_namespace(kube, ns, fake_nodes=True)
    op = OperatorProcess(
        kubeconfig=operator_kubeconfig, log_path=log_dir / f"operator-{count}.log", namespaces=(ns,)
    )
    op.start()
    time.sleep(3)  # let it list and watch before the burst
    op.assert_alive()
    names = [f"m{i:03d}" for i in range(count)]
    t0 = time.monotonic()
    t0_wall = time.time()
    kube.apply({"apiVersion": "v1", "kind": "List", "items": [llmd(n) for n in names]}, ns)
    applied = time.monotonic() - t0
    children_at: dict[str, float] = {}
    ready_at: dict[str, float] = {}
    deadline = t0 + 600
    while len(ready_at) < count and time.monotonic() < deadline:
        now = time.monotonic() - t0
        for sts in kube.items("statefulsets", "-n", ns):
            inst = sts["metadata"].get("labels", {}).get("app.kubernetes.io/instance")
            if inst and inst not in children_at:
                children_at[inst] = now
        for obj in kube.items("llmd", "-n", ns):
            cond = condition(obj, "Ready")
            if cond and cond["status"] == "True" and obj["metadata"]["name"] not in ready_at:
                ready_at[obj["metadata"]["name"]] = now
        op.assert_alive()
        time.sleep(0.5)
    if len(ready_at) < count:
        raise SystemExit(f"only {len(ready_at)}/{count} Ready after 600 s; operator log: {op.log_path}")
    # Steady state: count the operator's writes over a window after everything settled.
    time.sleep(5)
    audit = audit_log_path(kube)
    assert audit is not None, "the local control plane keeps an audit log"
    applied_at = children_applied(audit, OPERATOR_USER, ns, t0_wall)
    burst_writes = requests_made(audit, OPERATOR_USER, t0_wall)
    since = time.time()
    time.sleep(steady_s)
    writes = len(audited_writes(audit, OPERATOR_USER, since)) if audit else None
    rss = peak_rss_mib(op.proc.pid) if op.proc else float("nan")
    # Delete the objects while the operator runs, so its deletes are part of what is measured.
    kube.run("delete", "llmd", "--all", "-n", ns, "--wait=true", "--timeout=300s", timeout=330)
    op.stop()
    kube.run("delete", "namespace", ns, "--wait=true", "--timeout=300s", timeout=330)
    child_times = [at - t0_wall for at in applied_at.values()]
    assert len(child_times) == count, f"children of {len(child_times)}/{count} deployments in the audit log"
    ready_times = list(ready_at.values())
    return {
        "count": count,
        "apply_s": round(applied, 2),
        "children_p50_s": round(statistics.median(child_times), 2),
        "children_p99_s": round(percentile(child_times, 0.99), 2),
        # The same, counted from when the last LLMDeployment existed (the limit's clock starts
        # with every object in place; kubectl's apply of N objects itself takes seconds).
        "children_after_apply_p50_s": round(statistics.median(child_times) - applied, 2),
        "children_after_apply_p99_s": round(percentile(child_times, 0.99) - applied, 2),
        "first_statefulset_p50_s": round(statistics.median(children_at.values()), 2),
        "operator_writes_until_steady": burst_writes,
        "ready_p50_s": round(statistics.median(ready_times), 2),
        "ready_p99_s": round(percentile(ready_times, 0.99), 2),
        "ready_all_s": round(max(ready_times), 2),
        "operator_peak_rss_mib": round(rss, 1),
        "steady_writes_per_min": None if writes is None else round(writes * 60 / steady_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--steady-seconds", type=float, default=60)
    parser.add_argument("--limit-workers", type=int, default=8)
    args = parser.parse_args()

    subprocess.run([str(CLUSTER_SH), "up"], check=True)
    kube = Kubectl(local_kubeconfig(), local=True)
    kube.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    log_dir = REPO / ".cluster" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    operator_kubeconfig = make_operator_kubeconfig(kube, log_dir)
    for n in args.counts:
        # The limit right before the operator's run, against the same apiserver and load.
        limit = run_limit(kube, operator_kubeconfig, n, args.limit_workers)
        result = {**run_one(kube, operator_kubeconfig, n, args.steady_seconds, log_dir), **limit}
        result["ratio_p50"] = round(result["children_p50_s"] / result["limit_children_p50_s"], 2)
        result["ratio_p99"] = round(result["children_p99_s"] / result["limit_children_p99_s"], 2)
        result["ratio_after_apply_p99"] = round(
            result["children_after_apply_p99_s"] / result["limit_children_p99_s"], 2
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
