#!/usr/bin/env python3
"""The local cluster's real node: containerd, a kubelet and kube-proxy in namespaces of their own.

``cluster.sh`` drives it (``up`` brings the node up with the control plane, ``down`` removes it); the
tests and other scripts use ``cluster.sh real-node`` and ``cluster.sh import-image``.

Wiring (one node per cluster; every name below carries an 8-hex id of the state dir and cluster name,
so clusters of several worktrees never collide; docs/local-cluster.md has the diagram):

- network namespace ``sovereign-<id>``, joined to the host by a veth pair on 10.243.<slot>.0/30 (host
  .1, node .2); pods get 10.244.<slot>.0/24 on a bridge inside it, and the host a route to that subnet.
  The node namespace has no default route, so pod and service traffic can never leave the machine.
  Service addresses (10.0.0.0/16) route to the bridge there, where kube-proxy's DNAT takes over.
- mount namespace (bound at ``/run/sovereign/<id>/mnt``): containerd, the kubelet, kube-proxy and every
  mount they make live there, so nothing is mounted on the host. /var/lib and /var/log are the node's
  own directories there, and the kernel settings the kubelet insists on (vm.overcommit_memory=1,
  kernel.panic=10, ...) are files bound over /proc/sys, not changes to this shared machine.
- cgroups under ``/sovereign-<id>`` (the kubelet's cgroupRoot), removed by ``down``.
- the apiserver stays on 127.0.0.1; socat forwards the host side of the veth (the apiserver's
  advertise address, in its serving certificate) to it, for the kubelet, kube-proxy and pods.

Standard library only, like e2e/images/oci.py: cluster.sh runs it with the system's Python 3.11.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CLUSTER_DIR = HERE.parent
DEFAULT_BIN = CLUSTER_DIR / "bin"

NODE_NAME = "real-node-0"
# Labels a cloud CPU node carries, plus ours saying the node is real (the built-in model's pods select it).
NODE_LABELS = {
    "node.kubernetes.io/instance-type": "cpu-local",
    "topology.kubernetes.io/zone": "local-a",
    "sovereign.ai/real-node": "true",
}
# The apiserver's default service range (kwokctl does not set one); kubernetes.default is its first address.
SERVICE_CIDR = "10.0.0.0/16"  # cluster.sh's SERVICE_CIDR
DNS_SERVICE_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
LINK_NET = "10.243.{slot}.0/30"
POD_NET = "10.244.{slot}.0/24"
SLOTS = range(256)
RUN_ROOT = Path("/run/sovereign")
# What the kubelet writes to /proc/sys at start (protectKernelDefaults: false) or insists on (true).
# In the node's mount namespace these files are bound over /proc/sys, so the kubelet finds them set
# and this shared machine's kernel keeps its own settings.
KUBELET_KERNEL_SETTINGS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
COMMANDS_NEEDED = (
    "ip",
    "nsenter",
    "unshare",
    "mount",
    "umount",
    "iptables",
    "iptables-restore",
    "socat",
    "openssl",
)
NODE_BINARIES = (
    "kubelet",
    "kube-proxy",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "runc",
    "cni/bridge",
    "cni/host-local",
    "cni/loopback",
    "cni/portmap",
)


class NodeError(Exception):
    """Why the node cannot come up (or do what was asked), in one line for the user."""


# ---------------------------------------------------------------------------------------------------
# Layout: every name, path and address of one cluster's node (pure).


def node_id(state: Path, name: str) -> str:
    """8 hex digits naming this cluster's node on the machine: the same state dir and cluster name
    always give the same id, two worktrees (or two names) different ones."""
    return hashlib.sha1(f"{state.resolve()}\0{name}".encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Layout:
    name: str  # the cluster's name (SOVEREIGN_CLUSTER)
    state: Path  # the cluster's state dir (.cluster)
    bin: Path  # e2e/cluster/bin
    slot: int  # picks the /30 link and the /24 pod subnet
    # An orphan found on the machine is known by its id alone (its run dir may predate owner records).
    known_id: str | None = None

    @property
    def id(self) -> str:
        return self.known_id or node_id(self.state, self.name)

    @property
    def dir(self) -> Path:
        """Bulky state (images, pod volumes, logs): under the cluster's state dir."""
        return self.state / f"node-{self.name}"

    @property
    def run(self) -> Path:
        """Sockets, pid files and the mount namespace: a short path (a unix socket's holds 107 bytes)."""
        return RUN_ROOT / self.id

    @property
    def netns(self) -> str:
        return f"sovereign-{self.id}"

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.netns

    @property
    def mntns_path(self) -> Path:
        return self.run / "mnt"

    @property
    def host_veth(self) -> str:
        return f"sov{self.id}"  # 11 characters; interface names hold 15

    @property
    def link(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(LINK_NET.format(slot=self.slot))

    @property
    def host_ip(self) -> str:
        return str(self.link.network_address + 1)

    @property
    def node_ip(self) -> str:
        return str(self.link.network_address + 2)

    @property
    def pod_cidr(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(POD_NET.format(slot=self.slot))

    @property
    def cgroup_root(self) -> str:
        return f"/sovereign-{self.id}"

    @property
    def network_name(self) -> str:
        return f"sovereign-{self.id}"

    @property
    def containerd_socket(self) -> Path:
        return self.run / "containerd.sock"

    @property
    def etc(self) -> Path:
        return self.dir / "etc"

    @property
    def pki(self) -> Path:
        return self.etc / "pki"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    @property
    def var_lib(self) -> Path:
        """Bound over /var/lib in the node's mount namespace: /var/lib/kubelet, /var/lib/containerd and
        /var/lib/cni are the node's own there (the kubelet and CNI also write some fixed paths there)."""
        return self.dir / "var-lib"

    @property
    def var_log(self) -> Path:
        """Bound over /var/log in the node's mount namespace: /var/log/pods and /var/log/containers."""
        return self.dir / "var-log"


# ---------------------------------------------------------------------------------------------------
# Address slots (pure): a slot is free when no route on the host overlaps its networks and no other
# node claimed it.


def _networks_of_routes(routes: Iterable[dict[str, Any]]) -> list[tuple[ipaddress.IPv4Network, str]]:
    out = []
    for route in routes:
        dst = route.get("dst", "")
        if dst in ("", "default") or ":" in dst:
            continue
        try:
            out.append((ipaddress.IPv4Network(dst, strict=False), route.get("dev", "")))
        except ValueError:
            continue
    return out


def choose_slot(
    routes: Iterable[dict[str, Any]], claims: dict[int, str], own_id: str, own_dev: str, preferred: int | None
) -> int:
    """The slot for node ``own_id``: ``preferred`` (the one it had) if still free, else the lowest free one.

    ``routes`` are ``ip -j route`` objects of the host (every table); ``claims`` maps slots to the node
    ids that hold them. Routes through ``own_dev`` (this node's veth) do not count against it.
    """
    networks = [net for net, dev in _networks_of_routes(routes) if dev != own_dev]

    def free(slot: int) -> bool:
        if claims.get(slot, own_id) != own_id:
            return False
        mine = (
            ipaddress.IPv4Network(LINK_NET.format(slot=slot)),
            ipaddress.IPv4Network(POD_NET.format(slot=slot)),
        )
        return not any(net.overlaps(m) for net in networks for m in mine)

    if preferred is not None and preferred in SLOTS and free(preferred):
        return preferred
    for slot in SLOTS:
        if free(slot):
            return slot
    raise NodeError("no free address slot: every 10.243.N.0/30 + 10.244.N.0/24 pair is routed or claimed")


# ---------------------------------------------------------------------------------------------------
# Orphans (pure): a node whose cluster's state dir is gone can no longer be stopped by anyone (cluster.sh
# finds a node through that dir), so the next cluster brought up on the machine removes it.

OWNER_FILE = "owner"  # in the node's run dir: {"state": ..., "name": ...}


def owner_record(state: Path, name: str) -> str:
    return json.dumps({"state": str(state.resolve()), "name": name}) + "\n"


@dataclass(frozen=True)
class RunDir:
    """What the machine says about one node's run dir (``/run/sovereign/<id>``)."""

    id: str
    owner_state: Path | None  # None: no readable owner record (a node brought up before they existed)
    owner_name: str | None
    owner_records_it: bool  # the owner's state dir still holds the node's slot file
    daemons_alive: bool  # a pid file of the run dir names a live process
    age_s: float  # since the run dir last changed


# A run dir without an owner record may be one being set up right now (the record is written last).
UNOWNED_GRACE_S = 300


def orphans(run_dirs: Iterable[RunDir], own_id: str) -> list[tuple[RunDir, str]]:
    """The nodes to remove, each with why. A node is an orphan when its owner's state dir no longer
    records it (the worktree was deleted, or ``rm -rf`` got as far as it could while the cluster ran:
    mounts keep some directories), or when it has no owner record, nothing of it runs and it is older
    than ``UNOWNED_GRACE_S`` (then only its namespaces, link, cgroups and slot are left, which a stopped
    node's next ``up`` makes again). A node its owner still records is never touched."""
    out = []
    for run_dir in run_dirs:
        if run_dir.id == own_id:
            continue
        if run_dir.owner_state is not None:
            if not run_dir.owner_records_it:
                out.append((run_dir, f"its cluster's state dir {run_dir.owner_state} no longer records it"))
        elif not run_dir.daemons_alive and run_dir.age_s > UNOWNED_GRACE_S:
            out.append((run_dir, "it records no owner and none of its daemons runs"))
    return out


def processes_naming(cmdlines: Iterable[tuple[int, str]], state: Path) -> list[int]:
    """Pids whose command line names a path under ``state`` (a deleted cluster's control plane: etcd,
    the apiserver and the others run with their files there)."""
    prefix = str(state).rstrip("/") + "/"
    return [pid for pid, cmdline in cmdlines if prefix in cmdline]


# ---------------------------------------------------------------------------------------------------
# Configuration files (pure).


def containerd_config(layout: Layout, sandbox_image: str, *, restrict_oom_score_adj: bool) -> str:
    """containerd's config (version 4, containerd 2.3's): per-node paths everywhere, the CRI plugin on
    runc with cgroupfs, our CNI plugins, and the locally imported pause image pinned as the sandbox.

    ``restrict_oom_score_adj``: where root lacks CAP_SYS_RESOURCE (these VMs withhold it), no process
    may lower its oom_score_adj below its parent's, so pods get the kubelet's values clamped at
    containerd's own (as rootless containerd does) instead of failing to start."""
    run, bin_ = layout.run, layout.bin

    def q(value: str | Path) -> str:
        return json.dumps(str(value))  # a TOML basic string

    return f"""\
# Written by e2e/cluster/node/node.py for cluster '{layout.name}'.
version = 4
# /var/lib is the node's own in its mount namespace (Layout.var_lib).
root = "/var/lib/containerd"
state = {q(run / "containerd")}
imports = []
# NRI's socket is machine-wide (/var/run/nri); snapshotters and differs we do not use stay off.
disabled_plugins = [
  "io.containerd.nri.v1.nri",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs",
  "io.containerd.differ.v1.erofs",
  "io.containerd.tracing.processor.v1.otlp",
]

[plugins]
  [plugins.'io.containerd.server.v1.grpc']
    address = {q(layout.containerd_socket)}

  [plugins.'io.containerd.server.v1.ttrpc']
    address = {q(run / "containerd.sock.ttrpc")}

  [plugins.'io.containerd.internal.v1.opt']
    path = "/var/lib/containerd/opt"

  [plugins.'io.containerd.shim.v1.manager']
    socket_dir = {q(run / "s")}

  [plugins.'io.containerd.cri.v1.images']
    snapshotter = "overlayfs"
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = {q(sandbox_image)}
    [plugins.'io.containerd.cri.v1.images'.registry]
      # No registry configuration at all: images are imported (cluster.sh import-image), never pulled.
      config_path = {q(layout.etc / "registry.d")}

  [plugins.'io.containerd.cri.v1.runtime']
    # Pod network namespaces are mounted under the state dir, not the machine-wide /run/netns.
    netns_mounts_under_state_dir = true
    restrict_oom_score_adj = {"true" if restrict_oom_score_adj else "false"}
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = {q(bin_ / "runc")}
          Root = {q(run / "runc")}
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = [{q(bin_ / "cni")}]
      conf_dir = {q(layout.etc / "cni")}

  [plugins.'io.containerd.grpc.v1.cri']
    # Inside the node's network namespace: only the kubelet there reaches it.
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
"""


def cni_config(layout: Layout) -> dict[str, Any]:
    """A bridge with host-local addresses from this node's pod subnet, plus portmap for hostPort."""
    gateway = str(layout.pod_cidr.network_address + 1)
    return {
        "cniVersion": "1.0.0",
        "name": layout.network_name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                # Pods talk to each other, to services and to the host; nothing is NATed out (there is
                # no way out: the node's namespace has no default route).
                "ipMasq": False,
                # A pod reaching itself through its own Service comes back over the bridge port.
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(layout.pod_cidr), "gateway": gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(layout: Layout) -> dict[str, Any]:
    """The kubelet's KubeletConfiguration (JSON is YAML)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # These machines run cgroup v1; Kubernetes 1.35+ refuses it unless told otherwise
        # (docs/local-cluster.md says why that is acceptable here).
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": layout.cgroup_root,
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "address": layout.node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": str(layout.pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(layout.pki / "kubelet-serving.key"),
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True, "cacheTTL": "30s"},
            "x509": {"clientCAFile": str(layout.pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [DNS_SERVICE_IP],
        # Pods with dnsPolicy Default (CoreDNS) get this file: no upstream, so nothing asks the
        # machine's resolver (the sandbox's egress path) about cluster names.
        "resolvConf": str(layout.etc / "resolv.conf"),
        "volumePluginDir": "/var/lib/kubelet/volume-plugins",
        # Image GC off (100 %): the runtime image is big and expensive to import again; disk pressure
        # still evicts below the hard thresholds.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # Absolute thresholds sized for a 24 GiB, 2-core machine shared with other work.
        "evictionHard": {
            "memory.available": "500Mi",
            "nodefs.available": "2Gi",
            "nodefs.inodesFree": "5%",
            "imagefs.available": "2Gi",
            "imagefs.inodesFree": "5%",
        },
        "systemReserved": {"cpu": "100m", "memory": "1Gi"},
        "enforceNodeAllocatable": ["pods"],
        "maxPods": 110,
        "serializeImagePulls": False,
        # The kernel settings it wants are set in its mount namespace (KUBELET_KERNEL_SETTINGS).
        "protectKernelDefaults": False,
        "shutdownGracePeriod": "0s",
        "nodeStatusReportFrequency": "1m",
        "logging": {"format": "text"},
    }


def kube_proxy_config(layout: Layout) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(layout.etc / "kube-proxy.kubeconfig")},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": str(layout.pod_cidr),
        "bindAddress": "0.0.0.0",
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{layout.node_ip}/32"],
        # conntrack's table size is machine-wide (writable only from the host's namespace): leave it.
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def kubeconfig(server: str, ca: Path, cert: Path, key: Path, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }


COREFILE = f"""\
.:53 {{
    errors
    health {{
        lameduck 5s
    }}
    ready
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    prometheus :9153
    cache 30
    loop
    reload
    loadbalance
}}
"""


def coredns_manifests(image: str) -> list[dict[str, Any]]:
    """CoreDNS as kubeadm installs it (ServiceAccount, RBAC, Corefile, Deployment, the kube-dns
    Service at a fixed address), on the real node, from the locally imported image.

    No ``forward``: the cluster has no upstream resolver, so names outside cluster.local fail at once
    instead of leaking to the machine's resolver.
    """
    labels = {"k8s-app": "kube-dns"}
    meta = {
        "namespace": "kube-system",
        "labels": {**labels, "app.kubernetes.io/managed-by": "sovereign-node"},
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "coredns", **meta}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "system:coredns", "labels": meta["labels"]},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns", "labels": meta["labels"]},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:coredns",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "coredns", **meta},
            "data": {"Corefile": COREFILE},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "coredns", **meta},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": "coredns",
                        "priorityClassName": "system-cluster-critical",
                        "dnsPolicy": "Default",
                        "nodeSelector": {"sovereign.ai/real-node": "true"},
                        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
                        "securityContext": {
                            "runAsUser": 65532,
                            "runAsGroup": 65532,
                            "runAsNonRoot": True,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": "coredns",
                                "image": image,
                                "imagePullPolicy": "IfNotPresent",
                                "args": ["-conf", "/etc/coredns/Corefile"],
                                # Port 53 as a non-root user: containerd opens unprivileged ports in
                                # every pod (enable_unprivileged_ports, on by default in 2.x).
                                "ports": [
                                    {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                                    {"name": "metrics", "containerPort": 9153, "protocol": "TCP"},
                                ],
                                "resources": {
                                    "requests": {"cpu": "50m", "memory": "70Mi"},
                                    "limits": {"memory": "170Mi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [
                                    {"name": "config", "mountPath": "/etc/coredns", "readOnly": True}
                                ],
                                "livenessProbe": {
                                    "httpGet": {"path": "/health", "port": 8080},
                                    "initialDelaySeconds": 10,
                                    "timeoutSeconds": 5,
                                    "failureThreshold": 5,
                                },
                                "readinessProbe": {
                                    "httpGet": {"path": "/ready", "port": 8181},
                                    "periodSeconds": 2,
                                },
                            }
                        ],
                        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", **meta},
            "spec": {
                "clusterIP": DNS_SERVICE_IP,
                "selector": labels,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
                    {"name": "metrics", "port": 9153, "protocol": "TCP", "targetPort": 9153},
                ],
            },
        },
    ]


# ---------------------------------------------------------------------------------------------------
# Small parsers (pure).


def parse_env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines of a shell file like versions.env (comments and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        out[key.strip()] = value.strip().strip("\"'")
    return out


def _unescape_mount_path(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_below(mountinfo: str, roots: Sequence[Path]) -> list[str]:
    """Mount points in ``mountinfo`` (/proc/self/mountinfo) at or below any of ``roots``, deepest first
    (the order to unmount them in)."""
    prefixes = [str(root).rstrip("/") for root in roots]
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        point = _unescape_mount_path(fields[4])
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: (p.count("/"), p), reverse=True)


def archive_image(path: Path) -> tuple[str, str]:
    """(reference, manifest digest) of a one-image OCI image-layout archive that names its image, as
    e2e/images/oci.py and Docker 25+'s ``docker save`` write them."""
    try:
        with tarfile.open(path) as tar:
            member = tar.extractfile("index.json")
            if member is None:
                raise KeyError("index.json")
            index = json.load(member)
    except (OSError, tarfile.TarError, KeyError, json.JSONDecodeError) as exc:
        raise NodeError(f"{path}: not an OCI image archive with an index.json ({exc})") from exc
    manifests = index.get("manifests") or []
    if len(manifests) != 1:
        raise NodeError(f"{path}: expected one image in index.json, found {len(manifests)}")
    annotations = manifests[0].get("annotations") or {}
    ref = annotations.get("io.containerd.image.name")
    if not ref:
        raise NodeError(f"{path}: index.json names no image (annotation io.containerd.image.name)")
    return ref, manifests[0]["digest"]


def image_digests(ctr_images_ls: str) -> dict[str, str]:
    """reference -> target digest from ``ctr images ls`` output."""
    out = {}
    for line in ctr_images_ls.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[2].startswith("sha256:"):
            out[fields[0]] = fields[2]
    return out


def cgroup_hierarchies(mountinfo: str) -> dict[Path, set[str]]:
    """Mount point -> controllers of every cgroup hierarchy in ``mountinfo``: a v1 hierarchy's from its
    mount options (``{"cpu", "cpuacct"}``, ``{"name=systemd"}``), a v2 one's as ``{"cgroup2"}`` (its
    controllers are in its cgroup.controllers file). A hybrid machine has both."""
    out: dict[Path, set[str]] = {}
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = right.split()
        if not sep or len(fields) < 3 or fields[0] not in ("cgroup", "cgroup2"):
            continue
        point = Path(_unescape_mount_path(left.split()[4]))
        if fields[0] == "cgroup2":
            out[point] = {"cgroup2"}
        else:
            options = set(fields[2].split(","))
            out[point] = options - {"rw", "ro", "nosuid", "nodev", "noexec", "relatime", "clone_children"}
    return out


# ---------------------------------------------------------------------------------------------------
# The machine (the thin shell from here on).


def run(*argv: str | Path, check: bool = True, capture: bool = True, timeout: float = 120) -> str:
    proc = subprocess.run(
        [str(a) for a in argv], capture_output=capture, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise NodeError(f"{' '.join(map(str, argv[:4]))} failed: {detail[-1] if detail else proc.returncode}")
    return proc.stdout or ""


@dataclass
class Node:
    layout: Layout
    kubectl_kubeconfig: Path  # the admin's
    versions: dict[str, str]

    # -- paths ---------------------------------------------------------------------------------------
    @property
    def kwok_pki(self) -> Path:
        return self.layout.state / "kwok" / "clusters" / self.layout.name / "pki"

    def pid_file(self, daemon: str) -> Path:
        return self.layout.run / f"{daemon}.pid"

    # -- helpers ------------------------------------------------------------------------------------
    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        proc = subprocess.run(
            [str(self.layout.bin / "kubectl"), "--kubeconfig", str(self.kubectl_kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise NodeError(f"kubectl {' '.join(args[:3])} failed: {proc.stderr.strip()}")
        return proc.stdout

    def in_node(self, *argv: str | Path) -> list[str]:
        """argv run inside the node's mount and network namespaces."""
        return [
            "nsenter",
            f"--mount={self.layout.mntns_path}",
            f"--net={self.layout.netns_path}",
            "--",
            *map(str, argv),
        ]

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        return run(
            *self.in_node(
                self.layout.bin / "ctr", "--address", self.layout.containerd_socket, "-n", "k8s.io", *args
            ),
            check=check,
            timeout=timeout,
        )

    def containerd_answers(self) -> bool:
        try:
            self.ctr("version", timeout=10)
        except (NodeError, subprocess.TimeoutExpired):
            return False
        return True

    def running(self, daemon: str, binary: str) -> int | None:
        """The pid of ``daemon`` if its pid file names a live process running ``binary``."""
        try:
            pid = int(self.pid_file(daemon).read_text())
            exe = os.readlink(f"/proc/{pid}/exe")
        except (OSError, ValueError):
            return None
        return pid if Path(exe.removesuffix(" (deleted)")).name == binary else None

    def start(self, daemon: str, argv: list[str], *, in_node: bool = True) -> None:
        self.layout.logs.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": f"{self.layout.bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C",
        }
        with (self.layout.logs / f"{daemon}.log").open("ab") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                self.in_node(*argv) if in_node else argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives cluster.sh, like kwokctl's components
                env=env,
                close_fds=True,
            )
        # nsenter without --fork execs the daemon, so this is the daemon's pid.
        self.pid_file(daemon).write_text(f"{proc.pid}\n")

    def log_tail(self, daemon: str, lines: int = 5) -> str:
        try:
            text = (self.layout.logs / f"{daemon}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    # -- up -------------------------------------------------------------------------------------------
    def up(self, apiserver_port: int) -> None:
        layout = self.layout
        for d in (
            layout.dir,
            layout.run,
            layout.etc,
            layout.pki,
            layout.logs,
            layout.var_lib,
            layout.var_log,
            layout.etc / "cni",
        ):
            d.mkdir(parents=True, exist_ok=True)
        if self.mount_namespace_is_stale():
            # The state dir was removed under a node that was never brought down (a fresh clone at
            # the same path: the same id): its namespaces, daemons and pods belong to files that are
            # gone, and containerd would find /var/lib deleted. Stop all of it and start anew.
            print("node.py: stopping a node left by a removed state dir", file=sys.stderr)
            self.stop()
        self.ensure_network()
        self.ensure_mount_namespace()
        self.ensure_cgroups()
        stale = self.write_configs(apiserver_port)
        if self.write_pki():
            stale |= {"kubelet", "kube-proxy"}
        # A daemon whose configuration or certificate changed starts again with the new one.
        for daemon, binary in (
            ("kubelet", "kubelet"),
            ("kube-proxy", "kube-proxy"),
            ("containerd", "containerd"),
            ("apiserver-forward", "socat"),
        ):
            if daemon in stale:
                self.stop_daemon(daemon, binary)
            elif not self.running(daemon, binary):
                # Killed with the machine or the session that ran `up`: the wait below must not take
                # the dead pid for a daemon that just exited before this `up` starts it again.
                self.pid_file(daemon).unlink(missing_ok=True)

        if not self.running("containerd", "containerd"):
            self.start(
                "containerd",
                [str(layout.bin / "containerd"), "--config", str(layout.etc / "containerd.toml")],
            )
        self.wait("containerd to answer", self.containerd_answers, 30, "containerd")
        for archive in ("pause", "coredns"):
            self.import_image(layout.bin / "images" / f"{archive}.tar")

        if not self.running("apiserver-forward", "socat"):
            self.start(
                "apiserver-forward",
                [
                    shutil.which("socat") or "socat",
                    f"TCP-LISTEN:{apiserver_port},bind={layout.host_ip},reuseaddr,fork",
                    f"TCP:127.0.0.1:{apiserver_port}",
                ],
                in_node=False,
            )
        if not self.running("kubelet", "kubelet"):
            labels = ",".join(f"{k}={v}" for k, v in NODE_LABELS.items())
            self.start(
                "kubelet",
                [
                    str(layout.bin / "kubelet"),
                    f"--config={layout.etc / 'kubelet.json'}",
                    f"--kubeconfig={layout.etc / 'kubelet.kubeconfig'}",
                    f"--hostname-override={NODE_NAME}",
                    f"--node-ip={layout.node_ip}",
                    f"--node-labels={labels}",
                    "--v=1",
                ],
            )
        if not self.running("kube-proxy", "kube-proxy"):
            self.start(
                "kube-proxy",
                [str(layout.bin / "kube-proxy"), f"--config={layout.etc / 'kube-proxy.json'}", "--v=1"],
            )

        self.wait("the node to be Ready", self.node_ready, 90, "kubelet")
        self.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            "-",
            stdin=_as_list(coredns_manifests(self.versions["COREDNS_IMAGE"])),
        )
        self.wait(
            "CoreDNS to be ready",
            lambda: (
                self.kubectl(
                    "get",
                    "deployment",
                    "-n",
                    "kube-system",
                    "coredns",
                    "-o",
                    "jsonpath={.status.readyReplicas}",
                    check=False,
                ).strip()
                == "1"
            ),
            90,
            "kubelet",
        )

    def wait(self, what: str, ready: Callable[[], bool], timeout: float, log: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for daemon, binary in (
                ("containerd", "containerd"),
                ("kubelet", "kubelet"),
                ("kube-proxy", "kube-proxy"),
            ):
                if self.pid_file(daemon).exists() and not self.running(daemon, binary):
                    raise NodeError(f"{daemon} exited; {daemon}.log: {self.log_tail(daemon)}")
            time.sleep(0.5)
        raise NodeError(
            f"timed out after {timeout:.0f} s waiting for {what}; {log}.log: {self.log_tail(log)}"
        )

    def node_ready(self) -> bool:
        out = self.kubectl(
            "get",
            "node",
            NODE_NAME,
            "-o",
            'jsonpath={.status.conditions[?(@.type=="Ready")].status}',
            check=False,
        )
        return out.strip() == "True"

    def ensure_network(self) -> None:
        layout = self.layout
        if layout.netns_path.exists() and not _link_exists(layout.host_veth):
            run("ip", "netns", "delete", layout.netns)  # half made: start over
        if layout.netns_path.exists():
            return
        run("ip", "netns", "add", layout.netns)
        prefix = layout.link.prefixlen
        inside = ["nsenter", f"--net={layout.netns_path}", "--"]
        steps: list[list[str]] = [
            [
                "ip",
                "link",
                "add",
                layout.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                layout.netns,
            ],
            [*inside, "ip", "link", "set", "lo", "up"],
            [*inside, "ip", "addr", "add", f"{layout.node_ip}/{prefix}", "dev", "eth0"],
            [*inside, "ip", "link", "set", "eth0", "up"],
            # Service addresses: a route that exists (so a connect() from the node reaches OUTPUT, where
            # kube-proxy's DNAT rewrites it) and leads nowhere if nothing rewrites it: the pods' bridge
            # (made here, before the CNI plugin adopts it; these kernels have no dummy device).
            [*inside, "ip", "link", "add", "cni0", "type", "bridge"],
            [*inside, "ip", "link", "set", "cni0", "up"],
            [*inside, "ip", "route", "add", SERVICE_CIDR, "dev", "cni0"],
            # /proc/sys/net is the writer's network namespace: these are the node's, not the machine's.
            [*inside, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"],
            [*inside, "sh", "-c", "echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables"],
            ["ip", "addr", "add", f"{layout.host_ip}/{prefix}", "dev", layout.host_veth],
            ["ip", "link", "set", layout.host_veth, "up"],
            ["ip", "route", "replace", str(layout.pod_cidr), "via", layout.node_ip, "dev", layout.host_veth],
        ]
        try:
            for step in steps:
                run(*step)
        except NodeError:
            run("ip", "netns", "delete", layout.netns, check=False)
            raise

    def mount_namespace_is_stale(self) -> bool:
        """Whether the node's mount namespace exists with a /var/lib or /var/log that is not this
        layout's directory (an earlier one, since removed)."""
        layout = self.layout
        if not _is_mount_point(layout.mntns_path):
            return False
        stat = ["stat", "-c", "%d:%i", "/var/lib", "/var/log"]
        inside = run("nsenter", f"--mount={layout.mntns_path}", "--", *stat, check=False)
        ours = [os.stat(d) for d in (layout.var_lib, layout.var_log)]
        return inside.split() != [f"{st.st_dev}:{st.st_ino}" for st in ours]

    def ensure_mount_namespace(self) -> None:
        layout = self.layout
        if layout.mntns_path.exists() and _is_mount_point(layout.mntns_path):
            return
        settings = layout.etc / "kernel"
        binds: list[tuple[Path, str]] = []
        for key, value in KUBELET_KERNEL_SETTINGS.items():
            f = settings / key.replace("/", ".")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(value + "\n")
            binds.append((f, f"/proc/sys/{key}"))
        binds += [(layout.var_lib, "/var/lib"), (layout.var_log, "/var/log")]
        layout.mntns_path.touch()
        script = "; ".join(f"mount --bind {_shq(src)} {_shq(dst)}" for src, dst in binds)
        run("unshare", f"--mount={layout.mntns_path}", "--propagation", "private", "--", "sh", "-ec", script)

    def ensure_cgroups(self) -> None:
        """The kubelet's cgroupRoot must exist in every hierarchy before it starts."""
        for hierarchy in cgroup_hierarchies(Path("/proc/self/mountinfo").read_text()):
            root = hierarchy / self.layout.cgroup_root.lstrip("/")
            root.mkdir(exist_ok=True)
            for knob in ("cpuset.cpus", "cpuset.mems"):  # empty in a new cpuset cgroup: inherit
                if (root / knob).exists() and not (root / knob).read_text().strip():
                    (root / knob).write_text((hierarchy / knob).read_text())

    def write_pki(self) -> bool:
        """The kwok CA signs the kubelet's client (system:node:<name>, group system:nodes) and serving
        certificates and kube-proxy's client certificate (system:kube-proxy); made again when the CA
        changed. Returns whether they were (re)made."""
        pki = self.layout.pki
        ca_crt, ca_key = self.kwok_pki / "ca.crt", self.kwok_pki / "ca.key"
        if not ca_crt.exists():
            raise NodeError(f"{ca_crt} is missing: the control plane is not up")
        fingerprint = hashlib.sha256(ca_crt.read_bytes()).hexdigest()
        stamp = pki / "ca.sha256"
        if stamp.exists() and stamp.read_text().strip() == fingerprint and (pki / "kube-proxy.crt").exists():
            return False
        shutil.copyfile(ca_crt, pki / "ca.crt")
        self._sign("kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}", "clientAuth", ca_crt, ca_key)
        self._sign(
            "kubelet-serving",
            f"/CN={NODE_NAME}",
            "serverAuth",
            ca_crt,
            ca_key,
            san=f"DNS:{NODE_NAME},IP:{self.layout.node_ip}",
        )
        self._sign("kube-proxy", "/CN=system:kube-proxy", "clientAuth", ca_crt, ca_key)
        stamp.write_text(fingerprint + "\n")
        return True

    def _sign(
        self, name: str, subject: str, usage: str, ca_crt: Path, ca_key: Path, san: str | None = None
    ) -> None:
        pki = self.layout.pki
        ext = [
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature",
            f"extendedKeyUsage={usage}",
        ]
        if san:
            ext.append(f"subjectAltName={san}")
        with tempfile.TemporaryDirectory() as tmp:
            csr, extfile = Path(tmp) / "csr", Path(tmp) / "ext"
            extfile.write_text("\n".join(ext) + "\n")
            run("openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", pki / f"{name}.key", "-subj", subject, "-out", csr)  # fmt: skip
            run("openssl", "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-set_serial",
                f"0x{secrets.token_hex(8)}", "-days", "365", "-sha256", "-extfile", extfile,
                "-out", pki / f"{name}.crt")  # fmt: skip
        (pki / f"{name}.key").chmod(0o600)

    def write_configs(self, apiserver_port: int) -> set[str]:
        """Write the node's configuration files; returns the daemons whose files changed."""
        layout = self.layout
        server = f"https://{layout.host_ip}:{apiserver_port}"
        ca = layout.pki / "ca.crt"
        files: dict[Path, str] = {
            layout.etc / "containerd.toml": containerd_config(
                layout, self.versions["PAUSE_IMAGE"], restrict_oom_score_adj=not has_cap_sys_resource()
            ),
            layout.etc / "cni" / "10-sovereign.conflist": json.dumps(cni_config(layout), indent=2),
            layout.etc / "kubelet.json": json.dumps(kubelet_config(layout), indent=2),
            layout.etc / "kube-proxy.json": json.dumps(kube_proxy_config(layout), indent=2),
            layout.etc / "kubelet.kubeconfig": json.dumps(
                kubeconfig(
                    server,
                    ca,
                    layout.pki / "kubelet.crt",
                    layout.pki / "kubelet.key",
                    f"system:node:{NODE_NAME}",
                ),
                indent=2,
            ),
            layout.etc / "kube-proxy.kubeconfig": json.dumps(
                kubeconfig(
                    server,
                    ca,
                    layout.pki / "kube-proxy.crt",
                    layout.pki / "kube-proxy.key",
                    "system:kube-proxy",
                ),
                indent=2,
            ),
            layout.etc
            / "resolv.conf": "# The real node has no upstream resolver: cluster names go to CoreDNS only.\n",
        }
        (layout.etc / "registry.d").mkdir(exist_ok=True)
        # Who reads what; the kubeconfigs name the apiserver's port, which the forwarder listens on.
        readers = {
            "containerd.toml": ("containerd",),
            "kubelet.json": ("kubelet",),
            "kubelet.kubeconfig": ("kubelet", "apiserver-forward"),
            "kube-proxy.json": ("kube-proxy",),
            "kube-proxy.kubeconfig": ("kube-proxy",),
        }
        changed = set()
        for path, text in files.items():
            text = text if text.endswith("\n") else text + "\n"
            # Unchanged files are not touched: kube-proxy exits when its configuration file is written.
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                changed.update(readers.get(path.name, ()))
        return changed

    # -- images ---------------------------------------------------------------------------------------
    def import_image(self, archive: Path) -> str:
        """Import an oci.py archive into the node's containerd (CRI namespace k8s.io) unless the same
        image is already there under its name; returns what was done, for the user."""
        if not archive.is_file():
            raise NodeError(f"{archive}: no such file")
        ref, digest = archive_image(archive)
        if image_digests(self.ctr("images", "ls")).get(ref) == digest:
            return f"{ref} already present ({digest[:19]})"
        # The archive is read by containerd's own process through the transfer service.
        self.ctr("images", "import", "--no-unpack=false", str(archive.resolve()))
        got = image_digests(self.ctr("images", "ls")).get(ref)
        if got != digest:
            raise NodeError(f"{archive}: imported, but containerd lists {ref} as {got}, not {digest}")
        return f"{ref} imported ({digest[:19]})"

    # -- down -----------------------------------------------------------------------------------------
    def down(self) -> None:
        layout = self.layout
        self.stop()
        self.remove_cgroups()
        shutil.rmtree(layout.dir, ignore_errors=True)
        shutil.rmtree(layout.run, ignore_errors=True)
        release_slot(layout)

    def stop(self) -> None:
        """Every process of the node gone, its namespaces and mounts removed; its files kept."""
        layout = self.layout
        self.stop_daemon("kubelet", "kubelet")
        self.kill_cgroup_processes()
        for daemon, binary in (
            ("kube-proxy", "kube-proxy"),
            ("containerd", "containerd"),
            ("apiserver-forward", "socat"),
        ):
            self.stop_daemon(daemon, binary)
        self.kill_namespace_processes()
        if layout.mntns_path.exists() and _is_mount_point(layout.mntns_path):
            run("umount", layout.mntns_path, check=False)
        if layout.netns_path.exists():
            run("ip", "netns", "delete", layout.netns, check=False)
        if _link_exists(layout.host_veth):
            run("ip", "link", "delete", layout.host_veth, check=False)
        # Nothing of the node is mounted on the host; a mount left by an older run would be, deepest first.
        for point in mounts_below(Path("/proc/self/mountinfo").read_text(), [layout.dir, layout.run]):
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True)

    def stop_daemon(self, daemon: str, binary: str, grace: float = 10) -> None:
        pid = self.running(daemon, binary)
        if pid is not None:
            _terminate([pid], grace)
        self.pid_file(daemon).unlink(missing_ok=True)

    def cgroup_dirs(self) -> list[Path]:
        out = []
        for hierarchy in cgroup_hierarchies(Path("/proc/self/mountinfo").read_text()):
            root = hierarchy / self.layout.cgroup_root.lstrip("/")
            if root.is_dir():
                out.extend(
                    sorted((Path(d) for d, _, _ in os.walk(root)), key=lambda p: len(p.parts), reverse=True)
                )
        return out

    def kill_cgroup_processes(self) -> None:
        """SIGKILL every process in the node's cgroups (the pods' containers) until none is left."""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pids = {pid for d in self.cgroup_dirs() for pid in _read_pids(d / "cgroup.procs")}
            if not pids:
                return
            for pid in pids:
                _kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def kill_namespace_processes(self) -> None:
        """Processes still in the node's mount or network namespace (shims, a stray exec)."""
        inodes = {
            p.stat().st_ino for p in (self.layout.mntns_path, self.layout.netns_path) if _is_mount_point(p)
        }
        if not inodes:
            return
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if any((proc / "ns" / ns).stat().st_ino in inodes for ns in ("mnt", "net")):
                    pids.append(int(proc.name))
            except OSError:
                continue
        _terminate(pids, 5)

    def remove_cgroups(self) -> None:
        for d in self.cgroup_dirs():
            with contextlib.suppress(OSError):
                d.rmdir()

    # -- status ---------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """What is wrong with a node that should be up (empty: it is up and Ready)."""
        out = []
        for daemon, binary in (
            ("containerd", "containerd"),
            ("kubelet", "kubelet"),
            ("kube-proxy", "kube-proxy"),
            ("apiserver-forward", "socat"),
        ):
            if not self.running(daemon, binary):
                out.append(f"{daemon} is not running")
        if not out and not self.node_ready():
            out.append(f"node {NODE_NAME} is not Ready")
        return out


def has_cap_sys_resource() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (capability 24) in its effective set."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def _as_list(items: list[dict[str, Any]]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def _shq(value: str | Path) -> str:
    return "'" + str(value).replace("'", "'\\''") + "'"


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def _is_mount_point(path: Path) -> bool:
    target = str(path)
    try:
        return any(
            _unescape_mount_path(line.split()[4]) == target
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
        )
    except OSError:
        return False


def _read_pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _terminate(pids: Iterable[int], grace: float) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after ``grace`` seconds."""
    pending = [p for p in pids if _alive(p)]
    for pid in pending:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [p for p in pending if _alive(p)]
    for pid in pending:
        _kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------
# Slots on the machine.


def _claims() -> dict[int, str]:
    out = {}
    slots = RUN_ROOT / "slots"
    if slots.is_dir():
        for f in slots.iterdir():
            if f.name.isdigit():
                owner = f.read_text().strip()
                # A claim whose node is gone (its run dir removed) is stale.
                if (RUN_ROOT / owner).is_dir():
                    out[int(f.name)] = owner
    return out


def allocate_slot(state: Path, name: str, bin_: Path) -> Layout:
    """This cluster's layout, keeping the slot it had where still free, claiming it on the machine."""
    own_id = node_id(state, name)
    slot_file = state / f"node-{name}" / "slot"
    routes = json.loads(run("ip", "-j", "-4", "route", "show", "table", "all") or "[]")
    RUN_ROOT.joinpath("slots").mkdir(parents=True, exist_ok=True)
    (RUN_ROOT / own_id).mkdir(parents=True, exist_ok=True)
    claims = _claims()
    if slot_file.exists():
        preferred: int | None = int(slot_file.read_text())
    else:  # the state dir was removed: the slot a node of this id may still hold on the machine
        preferred = next((slot for slot, owner in claims.items() if owner == own_id), None)
    slot = choose_slot(routes, claims, own_id, f"sov{own_id}", preferred)
    claim = RUN_ROOT / "slots" / str(slot)
    # O_EXCL: of two clusters choosing at once, one wins; the other sees the claim next time.
    if not (claim.exists() and claim.read_text().strip() == own_id):
        if claim.exists():
            claim.unlink()  # stale (checked by _claims)
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(own_id + "\n")
    slot_file.parent.mkdir(parents=True, exist_ok=True)
    slot_file.write_text(f"{slot}\n")
    # Last: an owner record says the slot file exists (``orphans`` relies on it).
    (RUN_ROOT / own_id / OWNER_FILE).write_text(owner_record(state, name))
    return Layout(name=name, state=state.resolve(), bin=bin_, slot=slot)


def _run_dirs() -> list[RunDir]:
    out = []
    if not RUN_ROOT.is_dir():
        return out
    for d in RUN_ROOT.iterdir():
        if not (d.is_dir() and re.fullmatch(r"[0-9a-f]{8}", d.name)):
            continue
        owner_state = owner_name = None
        try:
            record = json.loads((d / OWNER_FILE).read_text())
            owner_state, owner_name = Path(record["state"]), str(record["name"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        alive = any(_alive(pid) for f in d.glob("*.pid") for pid in _read_pids(f))
        out.append(
            RunDir(
                id=d.name,
                owner_state=owner_state,
                owner_name=owner_name,
                owner_records_it=owner_state is not None
                and (owner_state / f"node-{owner_name}" / "slot").is_file(),
                daemons_alive=alive,
                age_s=time.time() - d.stat().st_mtime,
            )
        )
    return out


def _cmdlines() -> list[tuple[int, str]]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            out.append(
                (
                    int(proc.name),
                    (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"),
                )
            )
        except OSError:
            continue
    return out


def reap_orphans(own_id: str, bin_: Path) -> list[str]:
    """Remove every orphaned node on the machine (see ``orphans``): its processes and its deleted
    cluster's control plane, namespaces, link, cgroups, run dir and slot. One line per node removed."""
    lines = []
    claims = {owner: slot for slot, owner in _claims().items()}
    for run_dir, why in orphans(_run_dirs(), own_id):
        state = run_dir.owner_state or RUN_ROOT / run_dir.id / "unknown-owner"
        layout = Layout(
            name=run_dir.owner_name or "unknown",
            state=state,
            bin=bin_,
            slot=claims.get(run_dir.id, 0),
            known_id=run_dir.id,
        )
        if run_dir.owner_state is not None:
            _terminate(processes_naming(_cmdlines(), run_dir.owner_state), 5)
        orphan = Node(layout=layout, kubectl_kubeconfig=state / "none", versions={})
        orphan.stop()
        orphan.remove_cgroups()
        shutil.rmtree(layout.run, ignore_errors=True)
        release_slot(layout)
        lines.append(f"removed orphaned node {run_dir.id}: {why}")
    return lines


def release_slot(layout: Layout) -> None:
    claim = RUN_ROOT / "slots" / str(layout.slot)
    try:
        if claim.read_text().strip() == layout.id:
            claim.unlink()
    except OSError:
        pass


def existing_layout(state: Path, name: str, bin_: Path) -> Layout | None:
    slot_file = state / f"node-{name}" / "slot"
    try:
        return Layout(name=name, state=state.resolve(), bin=bin_, slot=int(slot_file.read_text()))
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------
# What the machine must offer.


def unsupported_reason(bin_: Path) -> str | None:
    """Why this machine cannot run the node, or None."""
    unbuildable = bin_ / ".node-unbuildable"
    if unbuildable.exists():
        return f"its binaries are not built: {unbuildable.read_text().strip()}"
    missing = [b for b in NODE_BINARIES if not os.access(bin_ / b, os.X_OK)]
    if missing:
        return f"{', '.join(missing)} not built in {bin_} (e2e/cluster/build.sh)"
    if os.geteuid() != 0:
        return f"it needs root (namespaces, mounts, cgroups) and this is uid {os.geteuid()}"
    if "overlay" not in Path("/proc/filesystems").read_text().split():
        return "the kernel has no overlayfs (containerd's snapshotter)"
    if not Path("/proc/self/ns/net").exists() or not Path("/proc/self/ns/mnt").exists():
        return "the kernel has no network or mount namespaces"
    controllers: set[str] = set()
    for point, names in cgroup_hierarchies(Path("/proc/self/mountinfo").read_text()).items():
        if names == {"cgroup2"}:
            with contextlib.suppress(OSError):
                controllers |= set((point / "cgroup.controllers").read_text().split())
        else:
            controllers |= names
    lacking = [c for c in ("cpu", "memory", "pids") if c not in controllers]
    if lacking:
        return f"cgroup controllers {', '.join(lacking)} are not mounted"
    commands = [c for c in COMMANDS_NEEDED if shutil.which(c) is None]
    if commands:
        return f"the commands {', '.join(commands)} are missing (Debian: iproute2 util-linux mount iptables socat openssl)"
    return None


# ---------------------------------------------------------------------------------------------------
# CLI


def _admin_kubeconfig(state: Path, name: str) -> Path:
    return state / "kwok" / "clusters" / name / "kubeconfig.yaml"


def _apiserver_port(kubeconfig_path: Path) -> int:
    match = re.search(r"server:\s*https://127\.0\.0\.1:(\d+)", kubeconfig_path.read_text())
    if not match:
        raise NodeError(f"{kubeconfig_path}: no https://127.0.0.1:PORT server in it")
    return int(match.group(1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The local cluster's real node (driven by cluster.sh).")
    parser.add_argument("--name", required=True, help="cluster name (SOVEREIGN_CLUSTER)")
    parser.add_argument("--state", required=True, type=Path, help="the cluster's state dir (.cluster)")
    parser.add_argument("--bin", type=Path, default=DEFAULT_BIN)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "plan", help="check the machine, pick addresses; print HOST_IP=... or the reason and exit 3"
    )
    sub.add_parser("up", help="bring the node up (idempotent)")
    sub.add_parser("down", help="remove the node: processes, namespaces, cgroups, state")
    sub.add_parser("status", help="one line; exit 0 when the node is up and Ready")
    sub.add_parser(
        "real-node",
        help="print the node's name; else the reason, exit 3 where the machine cannot run one, 1 otherwise",
    )
    imp = sub.add_parser("import-image", help="import image archives (oci.py / docker save) into the node")
    imp.add_argument("archives", nargs="+", type=Path)
    has = sub.add_parser("has-image", help="exit 0 when the node's containerd holds these image references")
    has.add_argument("refs", nargs="+")
    args = parser.parse_args(argv)

    state: Path = args.state
    # Beside the node's dir, which `down` removes: why the node is absent, and a failed start's logs.
    unavailable = state / f"node-{args.name}.unavailable"
    failed_logs = state / f"node-{args.name}.failed-logs"
    versions = parse_env_file((CLUSTER_DIR / "versions.env").read_text())

    def node(layout: Layout) -> Node:
        return Node(layout=layout, kubectl_kubeconfig=_admin_kubeconfig(state, args.name), versions=versions)

    try:
        if args.command == "plan":
            reason = unsupported_reason(args.bin)
            if reason:
                state.mkdir(parents=True, exist_ok=True)
                unavailable.write_text(reason + "\n")
                print(reason)
                return 3
            for line in reap_orphans(node_id(state, args.name), args.bin):
                print(f"node.py: {line}", file=sys.stderr)
            layout = allocate_slot(state, args.name, args.bin)
            print(f"HOST_IP={layout.host_ip}")
            print(f"NODE_IP={layout.node_ip}")
            print(f"POD_CIDR={layout.pod_cidr}")
            return 0
        layout = existing_layout(state, args.name, args.bin)
        if args.command == "down":
            if layout is not None:
                node(layout).down()
            else:
                shutil.rmtree(state / f"node-{args.name}", ignore_errors=True)
            return 0
        if args.command == "up":
            if layout is None:
                raise NodeError("no address slot: run 'plan' first (cluster.sh up does)")
            try:
                node(layout).up(_apiserver_port(_admin_kubeconfig(state, args.name)))
            except NodeError as exc:
                # Keep the logs for the user: cluster.sh tears a failed node down.
                shutil.rmtree(failed_logs, ignore_errors=True)
                if layout.logs.is_dir():
                    shutil.copytree(layout.logs, failed_logs)
                unavailable.write_text(f"{exc} (logs: {failed_logs})\n")
                raise
            unavailable.unlink(missing_ok=True)
            shutil.rmtree(failed_logs, ignore_errors=True)
            return 0
        # status, real-node, import-image: about a node that should be running. Exit status 3 says
        # this machine cannot run one (tests skip on it), 1 that it should be there and is not.
        reason = unsupported_reason(args.bin)
        if reason:
            print(f"node.py: no real node: {reason}", file=sys.stderr)
            return 3
        if layout is None or not layout.dir.is_dir():
            reason = (
                unavailable.read_text().strip()
                if unavailable.exists()
                else "it was not brought up (cluster.sh up)"
            )
            raise NodeError(f"no real node: {reason}")
        n = node(layout)
        if args.command in ("import-image", "has-image") and not n.running("containerd", "containerd"):
            raise NodeError("the real node's containerd is not running (cluster.sh up)")
        if args.command == "import-image":
            for archive in args.archives:
                print(n.import_image(archive))
            return 0
        if args.command == "has-image":
            held = image_digests(n.ctr("images", "ls"))
            missing = [ref for ref in args.refs if ref not in held]
            if missing:
                raise NodeError(f"the real node has no image {', '.join(missing)} (cluster.sh import-image)")
            return 0
        problems = n.problems()
        if problems:
            raise NodeError(f"real node {NODE_NAME} is down: {'; '.join(problems)}")
        if args.command == "status":
            print(
                f"real node {NODE_NAME}: Ready (pods {layout.pod_cidr}, node {layout.node_ip}, netns {layout.netns})"
            )
        else:
            print(NODE_NAME)
        return 0
    except NodeError as exc:
        print(f"node.py: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "COREFILE",
    "Layout",
    "Node",
    "NodeError",
    "archive_image",
    "cgroup_hierarchies",
    "choose_slot",
    "cni_config",
    "containerd_config",
    "coredns_manifests",
    "image_digests",
    "kube_proxy_config",
    "kubeconfig",
    "kubelet_config",
    "main",
    "mounts_below",
    "node_id",
    "orphans",
    "owner_record",
    "parse_env_file",
    "processes_naming",
    "reap_orphans",
]
