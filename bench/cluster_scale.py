"""Apply N LLMDeployments at once to the local control plane and time the operator against the
limit the apiserver allows, measured in the same run; then restart the operator on the N unchanged
deployments (the resync).

Per N:
- the limit: the same children, rendered beforehand, applied by a plain concurrent server-side-
  apply client (8 deployments in flight over persistent connections, the operator's own apply call
  and identity) to N LLMDeployments nobody reconciles;
- the operator: the N LLMDeployments created by one `kubectl apply --server-side` (as GitOps tools
  apply) in a namespace the operator serves; time until every child of each is applied (p50/p99,
  from the apiserver's audit log: the first successful write of each child), until each is Ready
  (p50/p99/last, polled every second or two), the operator's peak RSS, its apiserver requests by
  verb and status (no retry storm: the most writes any one object got), and its writes per minute
  in the steady state afterwards (target zero);
- the resync: the operator stopped (SIGTERM) and started again on the N unchanged deployments;
  time until it has reconciled all of them and its queues are empty ("all observed", from its
  /metrics), its reads until then (audit log), and its writes (target zero);
- CPU seconds of every control-plane process, of the operator and of the limit's client in each
  phase, to show where the time goes.

The ratio operator / limit is the figure that survives this shared machine's noise.

    .venv/bin/python bench/cluster_scale.py --counts 100 1000
    SOVEREIGN_CLUSTER=big .venv/bin/python bench/cluster_scale.py --counts 1000 --no-limit --no-cleanup
        # then: SOVEREIGN_CLUSTER=big e2e/cluster/cluster.sh down (faster than the collector's deletes)

Each N's operator figures are printed as soon as they are measured (`{"operator": ...}`), before the
deletes, then the whole row with the limit and the ratios.

It starts the local cluster if needed (e2e/cluster/cluster.sh up) and runs the operator as a
subprocess with the chart's RBAC, exactly as tests/cluster does. The deployments use the built-in
CPU model (unified mode: one worker StatefulSet and a router each, so two pods). Where the default
fake nodes cannot hold 2N pods, the bench adds fake CPU nodes shaped like kwok's CPU node (its
labels, annotations and taints, more capacity) and deletes them afterwards; its namespaces carry
the annotations that keep pods on kwok's fake nodes where the cluster has a real node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from cluster_helpers import (  # noqa: E402 - the helpers live with the cluster tests
    CLUSTER_SH,
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    WRITE_VERBS,
    Kubectl,
    OperatorProcess,
    audit_log_path,
    local_kubeconfig,
    make_operator_kubeconfig,
)
from lightkube import AsyncClient, KubeConfig  # noqa: E402
from sovereign_operator.api.document import parse_document  # noqa: E402
from sovereign_operator.kube import FIELD_MANAGER, Kube  # noqa: E402
from sovereign_operator.reconcile import with_applied_digest  # noqa: E402
from sovereign_operator.render import DeploymentRef, render  # noqa: E402

OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
# Pods the default fake nodes are left to hold; above it the bench adds nodes of BENCH_NODE_PODS.
DEFAULT_NODES_PODS = 300
BENCH_NODE_PODS = 500
# Namespaces whose pods go to kwok's fake nodes where the cluster also has a real node
# (PodNodeSelector and PodTolerationRestriction; without those admission plugins they do nothing).
FAKE_NODES_ANNOTATIONS = {
    "scheduler.alpha.kubernetes.io/node-selector": "type=kwok",
    "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps(
        [
            {"key": "kwok.x-k8s.io/node", "operator": "Equal", "value": "fake", "effect": "NoSchedule"},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
        separators=(",", ":"),
    ),
}
CHILD_RESOURCES = {
    "statefulsets",
    "deployments",
    "services",
    "poddisruptionbudgets",
    "configmaps",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "networkpolicies",
}


def llmd(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "sovereign.ai/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": "tiny", "source": {"builtin": "sovereign-tiny"}}, "mode": "unified"},
    }


def names(count: int) -> list[str]:
    return [f"m{i:04d}" for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- where the CPU goes ------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds (user + system) of the control plane's processes, the operator and this process."""

    def __init__(self) -> None:
        pids_dir = (
            REPO
            / ".cluster"
            / "kwok"
            / "clusters"
            / os.environ.get("SOVEREIGN_CLUSTER", "sovereign")
            / "pids"
        )
        self.pids = {p.stem: int(p.read_text().strip()) for p in pids_dir.glob("*.pid")}

    @staticmethod
    def seconds(pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def snapshot(self, operator_pid: int | None = None) -> dict[str, float]:
        out = {name: self.seconds(pid) for name, pid in self.pids.items()}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["bench-client"] = usage.ru_utime + usage.ru_stime
        if operator_pid is not None:
            out["operator"] = self.seconds(operator_pid)
        return out

    @staticmethod
    def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: round(after[k] - before[k], 1) for k in after if k in before}


# --- the audit log -----------------------------------------------------------------------------


class AuditLog:
    """The apiserver's audit log, read from a byte offset so each phase parses only its own lines."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size

    def events(self, offset: int, user: str) -> list[dict[str, Any]]:
        time.sleep(2)  # the apiserver writes its audit log asynchronously
        out = []
        with self.path.open("rb") as f:
            f.seek(offset)
            for line in f:
                if user.encode() not in line:
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # being written right now
                if event.get("user", {}).get("username") == user:
                    out.append(event)
        return out


def by_request(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One event per request (a watch is logged when it starts and when it ends)."""
    seen: dict[str, dict[str, Any]] = {}
    for event in events:
        seen.setdefault(event["auditID"], event)
    return list(seen.values())


# How long the operator must have written nothing before the steady state is measured.
STEADY_QUIET_S = 15.0


def requests_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    requests = by_request(events)
    verbs = Counter(e["verb"] for e in requests)
    failed = Counter(
        str(e["responseStatus"]["code"])
        for e in requests
        if e.get("responseStatus", {}).get("code", 200) >= 300 and e["verb"] != "watch"
    )
    per_object = Counter(
        (e["objectRef"].get("resource"), e["objectRef"].get("subresource"), e["objectRef"].get("name"))
        for e in requests
        if e["verb"] in WRITE_VERBS
    )
    status_writes = sum(
        1 for e in requests if e["verb"] == "patch" and e["objectRef"].get("subresource") == "status"
    )
    return {
        "requests": len(requests),
        "by_verb": dict(sorted(verbs.items())),
        "writes": sum(n for v, n in verbs.items() if v in WRITE_VERBS),
        "reads": sum(n for v, n in verbs.items() if v not in WRITE_VERBS),
        "status_writes": status_writes,
        "not_2xx": dict(sorted(failed.items())),
        "most_writes_to_one_object": max(per_object.values(), default=0),
    }


def children_applied(events: list[dict[str, Any]], ns: str) -> dict[str, float]:
    """Per LLMDeployment (by its name prefix), wall-clock time of the first successful write of
    its last child to be written: when all its children existed."""
    first: dict[str, float] = {}
    for event in events:
        ref = event.get("objectRef") or {}
        code = (event.get("responseStatus") or {}).get("code", 0)
        if event.get("verb") not in WRITE_VERBS or ref.get("namespace") != ns:
            continue
        if ref.get("resource") not in CHILD_RESOURCES or not 200 <= code < 300:
            continue
        key = f"{ref['resource']}/{ref['name']}"
        at = epoch(event["requestReceivedTimestamp"])
        first[key] = min(at, first.get(key, at))
    done: dict[str, float] = {}
    for key, at in first.items():
        instance = key.split("/", 1)[1].split("-", 1)[0]
        done[instance] = max(at, done.get(instance, at))
    return done


# --- nodes and namespaces ----------------------------------------------------------------------


@contextmanager
def bench_nodes(kube: Kubectl, pods: int, keep: bool = False) -> Iterator[list[str]]:
    """Fake CPU nodes for `pods` pods beyond what the default nodes hold, shaped like kwok's CPU
    node (labels, annotations, taints), deleted afterwards unless `keep`."""
    count = max(0, math.ceil((pods - DEFAULT_NODES_PODS) / BENCH_NODE_PODS))
    if count == 0:
        yield []
        return
    template = kube.get("node", "cpu-node-0")
    created = []
    try:
        for i in range(count):
            name = f"bench-cpu-{i}"
            labels = {**template["metadata"].get("labels", {}), "kubernetes.io/hostname": name}
            capacity = {
                "cpu": "512",
                "memory": "2Ti",
                "ephemeral-storage": "1Ti",
                "pods": str(BENCH_NODE_PODS),
            }
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": labels,
                    "annotations": template["metadata"].get("annotations", {}),
                },
                "spec": {"taints": template.get("spec", {}).get("taints", [])},
                "status": {"capacity": capacity, "allocatable": capacity},
            }
            kube.apply(node)
            created.append(name)
        kube.run(
            "wait", "--for=condition=Ready", *(f"node/{n}" for n in created), "--timeout=120s", timeout=150
        )
        yield created
    finally:
        if created and not keep:
            kube.run("delete", "node", *created, "--wait=true", check=False, timeout=300)


def bench_namespace(kube: Kubectl, name: str) -> None:
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "annotations": FAKE_NODES_ANNOTATIONS},
        }
    )


def create_deployments(kube: Kubectl, ns: str, count: int) -> float:
    """One `kubectl apply --server-side` of the N LLMDeployments; returns its seconds."""
    started = time.monotonic()
    kube.run(
        "apply",
        "--server-side",
        "-n",
        ns,
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [llmd(n) for n in names(count)]}),
        timeout=1800,
    )
    return time.monotonic() - started


def ready_names(kube: Kubectl, ns: str) -> set[str]:
    columns = 'custom-columns=N:.metadata.name,R:.status.conditions[?(@.type=="Ready")].status'
    out = kube.run("get", "llmd", "-n", ns, "-o", columns, "--no-headers", timeout=300).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()[1:] == ["True"]}


# --- the limit ---------------------------------------------------------------------------------


async def apply_all(kubeconfig: Path, per_deployment: list[list[dict[str, Any]]], workers: int) -> None:
    """The limit: a plain SSA client with `workers` deployments in flight over persistent
    connections, each deployment's children in render order (a RoleBinding needs its Role), sent
    by the operator's own apply call (so the client's cost per request is the same on both sides)."""
    kube = Kube(AsyncClient(KubeConfig.from_file(str(kubeconfig)), field_manager=FIELD_MANAGER))
    queue: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
    for children in per_deployment:
        queue.put_nowait(children)

    async def worker() -> None:
        while not queue.empty():
            for child in queue.get_nowait():
                await kube.apply(child)

    try:
        await asyncio.gather(*(worker() for _ in range(workers)))
    finally:
        await kube.close()


def run_limit(
    kube: Kubectl, audit: AuditLog, operator_kubeconfig: Path, count: int, workers: int
) -> dict[str, Any]:
    """The same children applied without the operator (nobody watches this namespace)."""
    ns = f"limit-{count}-{int(time.time())}"
    bench_namespace(kube, ns)
    create_deployments(kube, ns, count)
    children: list[list[dict[str, Any]]] = []
    for obj in kube.items("llmd", "-n", ns):
        parsed = parse_document(obj)
        ref = DeploymentRef(
            name=parsed.name, namespace=ns, uid=obj["metadata"]["uid"], generation=parsed.generation
        )
        # As the operator sends them: each with its rendering's digest.
        children.append([with_applied_digest(child)[0] for child in render(ref, parsed.spec).children])
    children.sort(key=lambda c: c[0]["metadata"]["name"])  # creation order, as kubectl applied them
    cpu = CpuMeter()
    offset = audit.mark()
    cpu_before = cpu.snapshot()
    since = time.time()
    asyncio.run(apply_all(operator_kubeconfig, children, workers))
    elapsed = time.time() - since
    cpu_spent = CpuMeter.spent(cpu_before, cpu.snapshot())
    done = [at - since for at in children_applied(audit.events(offset, OPERATOR_USER), ns).values()]
    kube.run("delete", "namespace", ns, "--wait=true", "--timeout=1200s", timeout=1260)
    assert len(done) == count, f"the limit run applied children of {len(done)}/{count} deployments"
    return {
        "limit_children": sum(len(c) for c in children),
        "limit_total_s": round(elapsed, 2),
        "limit_children_p50_s": round(statistics.median(done), 2),
        "limit_children_p99_s": round(percentile(done, 0.99), 2),
        "limit_cpu_s": cpu_spent,
    }


# --- the operator ------------------------------------------------------------------------------


def operator_metrics(port: int) -> dict[str, float]:
    """The operator's /metrics as {name{labels}: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metrics_answer(port: int) -> bool:
    try:
        operator_metrics(port)
    except OSError:
        return False
    return True


def all_observed(port: int, count: int) -> bool:
    """The operator has reconciled every deployment once, nothing waits in its queues."""
    try:
        values = operator_metrics(port)
    except OSError:
        return False
    reconciled = sum(v for k, v in values.items() if k.startswith("sovereign_operator_reconciles_total{"))
    queued = sum(v for k, v in values.items() if k.startswith("sovereign_operator_queue_depth{"))
    return values.get("sovereign_operator_cache_synced") == 1 and reconciled >= count and queued == 0


def start_operator(kubeconfig: Path, log_dir: Path, ns: str, count: int) -> tuple[OperatorProcess, int]:
    port = free_port()
    op = OperatorProcess(
        kubeconfig=kubeconfig,
        log_path=log_dir / f"operator-{count}.log",
        namespaces=(ns,),
        extra_args=(f"--health-port={port}",),
    )
    op.start()
    return op, port


def wait_until(what: str, predicate: Any, timeout: float, interval: float, op: OperatorProcess) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        op.assert_alive()
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise SystemExit(f"{what}: not within {timeout:.0f} s; operator log: {op.log_path}")


def run_operator(
    kube: Kubectl,
    audit: AuditLog,
    operator_kubeconfig: Path,
    count: int,
    steady_s: float,
    log_dir: Path,
    cleanup: bool = True,
) -> dict[str, Any]:
    ns = f"bench-{count}-{int(time.time())}"
    bench_namespace(kube, ns)
    op, port = start_operator(operator_kubeconfig, log_dir, ns, count)
    assert op.proc is not None
    wait_until("the operator's /metrics", lambda: metrics_answer(port), 120, 0.5, op)
    time.sleep(2)  # its watches are listing
    cpu = CpuMeter()
    poll_s = 1.0 if count <= 200 else 2.0

    # The burst: N deployments at once.
    offset = audit.mark()
    cpu_before = cpu.snapshot(op.proc.pid)
    t0 = time.monotonic()
    t0_wall = time.time()
    apply_s = create_deployments(kube, ns, count)
    ready_at: dict[str, float] = {}
    deadline = t0 + 600 + count
    while len(ready_at) < count and time.monotonic() < deadline:
        now = time.monotonic() - t0
        for name in ready_names(kube, ns) - set(ready_at):
            ready_at[name] = now
        op.assert_alive()
        time.sleep(poll_s)
    if len(ready_at) < count:
        raise SystemExit(f"only {len(ready_at)}/{count} Ready in time; operator log: {op.log_path}")
    burst_cpu = CpuMeter.spent(cpu_before, cpu.snapshot(op.proc.pid))
    time.sleep(5)
    burst = audit.events(offset, OPERATOR_USER)
    applied_at = children_applied(burst, ns)
    child_times = [at - t0_wall for at in applied_at.values()]
    assert len(child_times) == count, f"children of {len(child_times)}/{count} deployments in the audit log"
    ready_times = list(ready_at.values())

    # The steady state, once the operator has written nothing for STEADY_QUIET_S: the StatefulSet
    # and Deployment controllers report a pod available minReadySeconds (10 s) after Ready, and status
    # follows that (bounded wait).
    settle_until = time.monotonic() + 120
    offset = audit.mark()
    while time.monotonic() < settle_until:
        time.sleep(STEADY_QUIET_S)
        if requests_summary(audit.events(offset, OPERATOR_USER))["writes"] == 0:
            break
        offset = audit.mark()
    offset = audit.mark()
    time.sleep(steady_s)
    steady_writes = requests_summary(audit.events(offset, OPERATOR_USER))["writes"]
    rss = peak_rss_mib(op.proc.pid)

    # The resync: a restart on N unchanged deployments.
    op.stop()
    offset = audit.mark()
    restarted_wall = time.time()
    op, port = start_operator(operator_kubeconfig, log_dir, ns, count)
    assert op.proc is not None
    cpu_before = cpu.snapshot(op.proc.pid)
    observed_s = wait_until(
        "the restarted operator to observe all", lambda: all_observed(port, count), 600, 0.5, op
    )
    resync_cpu = CpuMeter.spent(cpu_before, cpu.snapshot(op.proc.pid))
    time.sleep(20)  # past the monitors' first rounds (15 s intervals): they write nothing either
    resync = audit.events(offset, OPERATOR_USER)
    observed_at = restarted_wall + observed_s
    resync_reads = requests_summary(
        [e for e in resync if epoch(e["requestReceivedTimestamp"]) <= observed_at]
    )
    resync_all = requests_summary(resync)
    resync_rss = peak_rss_mib(op.proc.pid)

    result = {
        "count": count,
        "apply_s": round(apply_s, 2),
        "children_p50_s": round(statistics.median(child_times), 2),
        "children_p99_s": round(percentile(child_times, 0.99), 2),
        # The same, counted from when the last LLMDeployment existed (the limit's clock starts
        # with every object in place).
        "children_after_apply_p50_s": round(statistics.median(child_times) - apply_s, 2),
        "children_after_apply_p99_s": round(percentile(child_times, 0.99) - apply_s, 2),
        "ready_p50_s": round(statistics.median(ready_times), 2),
        "ready_p99_s": round(percentile(ready_times, 0.99), 2),
        "ready_all_s": round(max(ready_times), 2),
        "operator_peak_rss_mib": round(rss, 1),
        "operator_requests_until_ready": requests_summary(burst),
        "steady_writes_per_min": round(steady_writes * 60 / steady_s, 2),
        "cpu_s_until_ready": burst_cpu,
        "resync_all_observed_s": round(observed_s, 2),
        "resync_requests_until_observed": resync_reads,
        "resync_writes_incl_20s_after": resync_all["writes"],
        "resync_peak_rss_mib": round(resync_rss, 1),
        "resync_cpu_s": resync_cpu,
    }
    print(json.dumps({"operator": result}), flush=True)  # before the cleanup, which takes long at N=1000
    if not cleanup:
        op.stop()
        print(f"left namespace {ns} in place (--no-cleanup)", flush=True)
        return result
    # Delete the objects while the operator runs: its deletes must not fail or storm either.
    kube.run("delete", "llmd", "--all", "-n", ns, "--wait=true", "--timeout=1200s", timeout=1260)
    op.stop()
    kube.run("delete", "namespace", ns, "--wait=true", "--timeout=1200s", timeout=1260)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--steady-seconds", type=float, default=60)
    parser.add_argument("--limit-workers", type=int, default=8)
    parser.add_argument("--no-limit", action="store_true", help="skip the limit run (quicker iterations)")
    parser.add_argument(
        "--no-cleanup",
        action="store_true",
        help="leave the deployments and their namespace (and any bench nodes) in place: at N=1000 the"
        " garbage collector's deletes take longer than the run; tear the cluster down instead",
    )
    args = parser.parse_args()

    subprocess.run([str(CLUSTER_SH), "up"], check=True)
    kube = Kubectl(local_kubeconfig())
    kube.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    path = audit_log_path(kube)
    assert path is not None, "the local control plane keeps an audit log"
    policy = (REPO / ".cluster" / "kwok" / "clusters").glob("*/audit.yaml")
    assert any(re.search(r"system:serviceaccounts:sovereign-system", p.read_text()) for p in policy), (
        "the cluster's audit policy predates reads being logged: e2e/cluster/cluster.sh down && up"
    )
    audit = AuditLog(path)
    log_dir = REPO / ".cluster" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    operator_kubeconfig = make_operator_kubeconfig(kube, log_dir)
    for n in args.counts:
        with bench_nodes(kube, 2 * n, keep=args.no_cleanup) as nodes:
            # The limit right before the operator's run, against the same apiserver and load.
            limit = (
                {} if args.no_limit else run_limit(kube, audit, operator_kubeconfig, n, args.limit_workers)
            )
            result = {
                **run_operator(
                    kube, audit, operator_kubeconfig, n, args.steady_seconds, log_dir, not args.no_cleanup
                ),
                **limit,
            }
            result["bench_nodes"] = len(nodes)
        result["load_average"] = os.getloadavg()
        if limit:
            result["ratio_p50"] = round(result["children_p50_s"] / result["limit_children_p50_s"], 2)
            result["ratio_p99"] = round(result["children_p99_s"] / result["limit_children_p99_s"], 2)
            result["ratio_after_apply_p99"] = round(
                result["children_after_apply_p99_s"] / result["limit_children_p99_s"], 2
            )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
