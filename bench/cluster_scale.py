"""Apply N LLMDeployments at once to the local control plane and time the operator.

Reports, per N: time from the apply until each LLMDeployment has its StatefulSet (p50/p99), until
each is Ready (p50/p99, and the last one), the operator's peak RSS, and the operator's API writes
per minute in the steady state afterwards (counted in the apiserver's audit log; target zero).

    .venv/bin/python bench/cluster_scale.py --counts 10 100

It starts the local cluster if needed (e2e/cluster/cluster.sh up) and runs the operator as a
subprocess with the chart's RBAC, exactly as tests/cluster does. The deployments use the built-in
CPU model (unified mode: one worker StatefulSet and a router each), so 100 fit on the fake nodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
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
    local_kubeconfig,
    make_operator_kubeconfig,
)

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


def run_one(
    kube: Kubectl, operator_kubeconfig: Path, count: int, steady_s: float, log_dir: Path
) -> dict[str, Any]:
    ns = f"bench-{count}-{int(time.time())}"
    kube.run("create", "namespace", ns)
    op = OperatorProcess(
        kubeconfig=operator_kubeconfig, log_path=log_dir / f"operator-{count}.log", namespaces=(ns,)
    )
    op.start()
    time.sleep(3)  # let it list and watch before the burst
    op.assert_alive()
    names = [f"m{i:03d}" for i in range(count)]
    t0 = time.monotonic()
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
    since = time.time()
    time.sleep(steady_s)
    writes = len(audited_writes(audit, OPERATOR_USER, since)) if audit else None
    rss = peak_rss_mib(op.proc.pid) if op.proc else float("nan")
    # Delete the objects while the operator runs, so its deletes are part of what is measured.
    kube.run("delete", "llmd", "--all", "-n", ns, "--wait=true", "--timeout=300s", timeout=330)
    op.stop()
    kube.run("delete", "namespace", ns, "--wait=true", "--timeout=300s", timeout=330)
    child_times = list(children_at.values())
    ready_times = list(ready_at.values())
    return {
        "count": count,
        "apply_s": round(applied, 2),
        "children_p50_s": round(statistics.median(child_times), 2),
        "children_p99_s": round(percentile(child_times, 0.99), 2),
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
    args = parser.parse_args()

    subprocess.run([str(CLUSTER_SH), "up"], check=True)
    kube = Kubectl(local_kubeconfig())
    kube.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    log_dir = REPO / ".cluster" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    operator_kubeconfig = make_operator_kubeconfig(kube, log_dir)
    for n in args.counts:
        print(json.dumps(run_one(kube, operator_kubeconfig, n, args.steady_seconds, log_dir)), flush=True)


if __name__ == "__main__":
    main()
