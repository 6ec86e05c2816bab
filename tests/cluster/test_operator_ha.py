"""Two operator replicas on one leader-election Lease, on the real control plane.

The leader is killed (SIGKILL), cut off from the apiserver (its connections go through a proxy
the test closes: a network partition), frozen (SIGSTOP, right after a spec change it has begun to
act on; resumed with SIGCONT once the standby leads) and stopped (SIGTERM) in turn while the
LLMDeployment changes; after each fault the standby takes over and converges the change, and the
apiserver's audit log shows every write came from the replica that held the Lease at that moment:
never both. The frozen leader, resumed, writes nothing and exits.

The replicas watch a namespace of their own (not the session's prefix), so the session's operator
never competes with them, and each has its own ServiceAccount, so the audit log tells them apart.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from cluster_helpers import (
    OPERATOR_NAMESPACE,
    REPO,
    Kubectl,
    OperatorProcess,
    audit_log_path,
    audited_writes,
    create_namespace,
    llmd,
    make_operator_kubeconfig,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.local_operator]

LEASE = "sovereign-operator"
LEASE_RULES = REPO / "charts" / "sovereign" / "files" / "operator-leader-election-rules.yaml"
TINY = {
    "model": {"name": "sovereign-tiny", "source": {"builtin": "sovereign-tiny"}},
    "mode": "unified",
    "runtime": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
    "decode": {"replicas": 1},
}
# The defaults a chart install uses (values.yaml leaderElection).
LEASE_DURATION, RENEW_DEADLINE, RETRY = 10.0, 6.0, 1.5


class Partition:
    """A TCP proxy between one replica and the apiserver that the test can cut and heal."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open = True
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)  # watches stay idle for minutes
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        self.open = False
        with self.lock:
            for conn in self.conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                    conn.close()
                except OSError:
                    pass
            self.conns.clear()

    def heal(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        self.server.close()


def through(partition: Partition, kubeconfig: Path) -> Path:
    config = yaml.safe_load(kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{partition.port}"
    path = kubeconfig.with_name(kubeconfig.name + "-proxied")
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def apiserver_address(kubeconfig: Path) -> tuple[str, int]:
    server = urlparse(yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"])
    return server.hostname or "127.0.0.1", server.port or 443


def lease(kube: Kubectl, ns: str) -> dict[str, Any]:
    return (kube.get_or_none("lease", LEASE, "-n", ns) or {}).get("spec", {})


def micro_epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def wait_for_standby(proc: OperatorProcess, or_leader: bool = False) -> None:
    """Until the (re)started replica is up and watching the Lease, plus two of its attempts: a
    standby can only time a holder's silence from when it first saw the Lease (Python and kopf take
    seconds to start on a loaded machine, which would otherwise count as takeover time)."""

    def up() -> bool:
        since_start = proc.tail(400).rsplit("===== start #", 1)[-1]
        return "waiting for Lease" in since_start or (or_leader and "acquired Lease" in since_start)

    wait_for("the replica to watch the Lease", up, timeout=60)
    time.sleep(2 * RETRY)


@pytest.fixture
def ha_namespace(kube: Kubectl, operator_kubeconfig: Path) -> Iterator[str]:
    # operator_kubeconfig: the session's fixture has created the chart's ClusterRole.
    name = f"ha-{secrets.token_hex(3)}"
    create_namespace(kube, name, fake_nodes=True)
    rules = yaml.safe_load(LEASE_RULES.read_text())
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "Role",
                    "metadata": {"name": "leader-election", "namespace": name},
                    "rules": rules,
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": "leader-election", "namespace": name},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "Role",
                        "name": "leader-election",
                    },
                    "subjects": [
                        {"kind": "ServiceAccount", "name": sa, "namespace": OPERATOR_NAMESPACE}
                        for sa in ("sovereign-ha-a", "sovereign-ha-b")
                    ],
                },
            ],
        }
    )
    try:
        yield name
    finally:
        kube.run("delete", "namespace", name, "--wait=true", "--timeout=90s", check=False, timeout=120)


def test_standby_takes_over_from_a_killed_partitioned_frozen_or_stopped_leader_and_never_both_write(
    kube: Kubectl, ha_namespace: str, tmp_path: Path
) -> None:
    ns = ha_namespace
    audit = audit_log_path(kube)
    assert audit is not None, (
        "the local control plane keeps an audit log (e2e/cluster/kwok/audit-policy.yaml)"
    )
    log_dir = REPO / ".cluster" / "test-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    replicas: dict[str, tuple[OperatorProcess, Partition]] = {}
    for identity in ("ha-a", "ha-b"):
        config = make_operator_kubeconfig(kube, tmp_path, service_account=f"sovereign-{identity}")
        partition = Partition(apiserver_address(config))
        proc = OperatorProcess(
            kubeconfig=through(partition, config),
            log_path=log_dir / f"operator-{ns}-{identity}.log",
            namespaces=(ns,),
            extra_env={"POD_NAME": identity},
            extra_args=(
                "--leader-elect",
                f"--leader-election-namespace={ns}",
                f"--leader-election-lease-duration={LEASE_DURATION}",
                f"--leader-election-renew-deadline={RENEW_DEADLINE}",
                f"--leader-election-retry-period={RETRY}",
            ),
        )
        replicas[identity] = (proc, partition)
    started = time.time()
    # Holder intervals as the test sees them: (identity, from, to) in wall-clock seconds.
    terms: list[list[Any]] = []
    takeovers: list[tuple[str, float]] = []
    holder: str | None = None
    try:
        for proc, _ in replicas.values():
            proc.start()
        for proc, _ in replicas.values():
            wait_for_standby(proc, or_leader=True)
        holder = wait_for("a leader", lambda: lease(kube, ns).get("holderIdentity"), timeout=60)
        terms.append([holder, micro_epoch(lease(kube, ns)["acquireTime"]), None])
        kube.apply(llmd("tiny", TINY), ns)
        wait_for(
            "the leader's StatefulSet",
            lambda: kube.get_or_none("statefulset", "tiny-unified", "-n", ns),
            timeout=60,
        )

        for round_, fault in enumerate(("kill", "partition", "freeze", "terminate"), start=1):
            leader_proc, leader_partition = replicas[holder]
            standby = next(name for name in replicas if name != holder)
            if fault == "freeze":
                # A change the leader is about to act on when it freezes: once resumed, whatever it
                # had in flight must not reach the apiserver (the new leader owns the object).
                kube.apply(llmd("tiny", {**TINY, "decode": {"replicas": 10 + round_}}), ns)
                time.sleep(0.05)
            fault_at = time.time()
            if fault == "kill":
                leader_proc.kill()
            elif fault == "terminate":
                leader_proc.stop()  # SIGTERM: finish in-flight work, release the Lease at once
            elif fault == "freeze":
                assert leader_proc.proc is not None
                leader_proc.proc.send_signal(signal.SIGSTOP)
            else:
                leader_partition.cut()
            # Its term ends when it can write no more: at once for a kill or a partition, once the
            # process has exited for a graceful stop (it finishes in-flight work as the leader).
            terms[-1][2] = time.time() if fault == "terminate" else fault_at
            # Change the spec while the leader is gone: the new leader must converge it.
            spec = {**TINY, "decode": {"replicas": 1 + round_}}
            kube.apply(llmd("tiny", spec), ns)
            new = wait_for(
                f"the standby {standby} to take the Lease after the leader's {fault}",
                lambda standby=standby: lease(kube, ns).get("holderIdentity") == standby and lease(kube, ns),
                timeout=LEASE_DURATION + 10 * RETRY + 15,
                interval=0.2,
            )
            acquired = micro_epoch(new["acquireTime"])
            takeovers.append((fault, acquired - fault_at))
            terms.append([standby, acquired, None])
            wait_for(
                f"the new leader to converge decode.replicas={1 + round_}",
                lambda r=round_: (
                    ((kube.get_or_none("statefulset", "tiny-unified", "-n", ns) or {}).get("spec", {})).get(
                        "replicas"
                    )
                    == 1 + r
                ),
                timeout=60,
            )
            if fault == "partition":
                # A partitioned leader fences itself and exits before its Lease can expire.
                wait_for(
                    "the partitioned leader to exit",
                    lambda p=leader_proc: p.proc.poll() is not None,
                    timeout=RENEW_DEADLINE + 5,
                )
                leader_partition.heal()
            if fault == "freeze":
                # Resumed long after its renew deadline: it finds itself no longer the leader,
                # writes nothing (fenced) and exits; the new leader's replicas stand.
                assert leader_proc.proc is not None
                leader_proc.proc.send_signal(signal.SIGCONT)
                wait_for(
                    "the resumed leader to exit",
                    lambda p=leader_proc: p.proc.poll() is not None,
                    timeout=RENEW_DEADLINE + 10,
                )
                time.sleep(2)
                sts = kube.get_or_none("statefulset", "tiny-unified", "-n", ns) or {}
                assert sts.get("spec", {}).get("replicas") == 1 + round_, "the resumed leader wrote"
            leader_proc.start()  # back as the standby
            wait_for_standby(leader_proc)
            holder = standby
        # The last standby really waits: the Lease stays where it is.
        time.sleep(2 * RETRY)
        assert lease(kube, ns)["holderIdentity"] == holder
    finally:
        # Standbys first: a leader stopped first hands the Lease over, and the standby taking it would
        # write as a leader in a term this test does not record.
        for name in sorted(replicas, key=lambda name: name == holder):
            proc, partition = replicas[name]
            proc.stop()
            partition.close()

    # Every write in the namespace by either replica fell inside one of its own terms.
    bad = []
    for identity in replicas:
        user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:sovereign-{identity}"
        mine = [(start, end) for who, start, end in terms if who == identity]
        for event in audited_writes(audit, user, started):
            if event.get("objectRef", {}).get("namespace") != ns:
                continue
            at = micro_epoch(event["requestReceivedTimestamp"])
            # 0.5 s either side: a request sent just before a fault is received just after it.
            if not any(
                start - 0.5 <= at <= (end + 0.5 if end is not None else float("inf")) for start, end in mine
            ):
                ref = event["objectRef"]
                bad.append(f"{identity} {event['verb']} {ref.get('resource')}/{ref.get('name')} at {at:.3f}")
    assert not bad, f"writes by a replica that did not hold the Lease: {bad}; terms: {terms}"
    report = log_dir / f"failover-{ns}.json"
    report.write_text(json.dumps({"takeover_s": takeovers, "terms": terms}, indent=2))
    print(f"takeover after fault (s): {takeovers}")
    for fault, seconds in takeovers:
        # The bounds are the Lease's own arithmetic plus scheduling slack on a loaded machine: a
        # released Lease is taken at the standby's next attempt, an abandoned one after expiry.
        bound = 3 * RETRY + 10 if fault == "terminate" else LEASE_DURATION + 3 * RETRY + 10
        assert seconds < bound, f"takeover after {fault} took {seconds:.1f} s (bound {bound:.0f} s)"
