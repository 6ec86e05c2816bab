#!/usr/bin/env bash
# The local cluster: real etcd, kube-apiserver, kube-controller-manager and kube-scheduler (built by
# build.sh) run by `kwokctl --runtime binary`, with kwok faking the GPU nodes and their pods' lifecycle,
# LeaderWorkerSet's controller next to them (lws.sh), and one real worker node (kubelet, containerd,
# kube-proxy, CoreDNS: node/node.py) where the machine allows it (root, cgroups, overlayfs, namespaces).
#
#   cluster.sh up         create (or reuse, or restart) the cluster; kubeconfig -> .cluster/kubeconfig
#   cluster.sh down       delete it, the real node included (processes, namespaces, cgroups, state)
#   cluster.sh restart [etcd] [kube-apiserver]  restart those on their data (fault tests; both by default)
#   cluster.sh rdma on|off  give the GPU nodes the RDMA device-plugin resource, or take it away
#   cluster.sh status     is it up, and is the real node?
#   cluster.sh real-node  print the real node's name, or why there is none (exit 3 where this machine
#                         cannot run one, 1 where it should be up and is not)
#   cluster.sh import-image FILE.tar...  import image archives into the real node (idempotent)
#   cluster.sh has-image REF...  succeed when the real node holds these images
#   cluster.sh fake-namespace NAME...  create (or mark) namespaces whose pods all go to kwok's fake nodes
#   cluster.sh audit-log  path of the apiserver's audit log of writes (kwok/audit-policy.yaml)
#
# Environment: SOVEREIGN_CLUSTER (cluster name, default "sovereign"), SOVEREIGN_CLUSTER_DIR (state,
# default <repo>/.cluster). The control plane runs as plain processes of the current user on
# 127.0.0.1; the real node runs as root in network and mount namespaces of its own.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin="$here/bin"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$here/versions.env"
# shellcheck source-path=SCRIPTDIR source=node/packages.sh
source "$here/node/packages.sh"

name="${SOVEREIGN_CLUSTER:-sovereign}"
state="${SOVEREIGN_CLUSTER_DIR:-$repo/.cluster}"
kubeconfig="$state/kubeconfig"
# A second cluster (another name) gets its own kubeconfig next to the default one.
[[ "$name" == sovereign ]] || kubeconfig="$state/kubeconfig-$name"

# kwokctl keeps its clusters under KWOK_WORKDIR; every component points at our own binaries because
# each default is a download URL.
export KWOK_WORKDIR="$state/kwok"
export KWOK_RUNTIME=binary
export KWOK_KUBE_VERSION="$KUBE_VERSION"
export KWOK_ETCD_VERSION="${ETCD_VERSION#v}"
export KWOK_ETCD_BINARY="$bin/etcd"
export KWOK_KUBE_APISERVER_BINARY="$bin/kube-apiserver"
export KWOK_KUBE_CONTROLLER_MANAGER_BINARY="$bin/kube-controller-manager"
export KWOK_KUBE_SCHEDULER_BINARY="$bin/kube-scheduler"
export KWOK_KUBECTL_BINARY="$bin/kubectl"
export KWOK_CONTROLLER_BINARY="$bin/kwok"

kwokctl() { "$bin/kwokctl" --name "$name" "$@"; }
kubectl() { "$bin/kubectl" --kubeconfig "$kubeconfig" "$@"; }
node_py() { python3 "$here/node/node.py" --name "$name" --state "$state" --bin "$bin" "$@"; }
cluster_kubeconfig() { echo "$KWOK_WORKDIR/clusters/$name/kubeconfig.yaml"; }

free_ports() {
  # Ports the kernel hands out now; a race with another process is possible but harmless (create fails loudly).
  python3 -c 'import socket,sys
socks=[socket.socket() for _ in range(int(sys.argv[1]))]
[s.bind(("127.0.0.1",0)) for s in socks]
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

exists() { [[ -f "$KWOK_WORKDIR/clusters/$name/kwok.yaml" ]]; }

# Fake pods get IPs on the loopback network, where nothing listens on the runtime's port 8000 (the
# tests' and the demo's runtimes bind 127.0.0.1 on free ports): the operator's health reads are
# refused at once, the same way every round. On kwok's default 10.0.0.0/24 they reached whatever the
# machine routes there (a sandbox's egress proxy answered 404, or timed out under load), and the
# health conditions changed with it.
POD_CIDR=127.0.80.0/24
# Room for a fleet's Services (bench/cluster_scale.py makes 1000 ClusterIPs); the apiserver's
# default is a /24. The `kubernetes` Service keeps 10.0.0.1.
SERVICE_CIDR=10.0.0.0/16
# Admission as on a GPU cloud cluster: NodeRestriction (the kubelet may only touch its own node and
# pods); ExtendedResourceToleration (a pod requesting nvidia.com/gpu tolerates the GPU nodes' taint);
# PodNodeSelector and PodTolerationRestriction (a namespace's annotations send all its pods to the fake
# nodes: `fake-namespace`). The default plugins stay on.
ADMISSION_PLUGINS=NodeRestriction,ExtendedResourceToleration,PodNodeSelector,PodTolerationRestriction
# The real node's CPU taint on kwok's CPU node, so un-annotated namespaces get real pods.
FAKE_CPU_TAINT=kwok.x-k8s.io/node=fake:NoSchedule
# One controller-manager and one scheduler: without leader election they survive an etcd or
# apiserver restart (`restart`), where a lost lease would make them exit.
# What `create` was given that an existing cluster must match; a mismatch recreates it (the real
# node's address is in the apiserver's certificate and its advertise address).
create_stamp_of() { echo "pod-cidr=$POD_CIDR service-cidr=$SERVICE_CIDR leader-elect=false audit=$(sha256sum "$here/kwok/audit-policy.yaml" | cut -c1-12) admission=$ADMISSION_PLUGINS kwok-manages=annotated node=$1"; }
stamp_file() { echo "$KWOK_WORKDIR/clusters/$name/sovereign-create-stamp"; }

healthy() {
  [[ -f "$kubeconfig" ]] && kubectl get --raw /readyz >/dev/null 2>&1
}

wait_ready() {
  local _
  for _ in $(seq 1 120); do
    healthy && return 0
    sleep 0.5
  done
  echo "cluster.sh: the apiserver of cluster '$name' did not become ready in 60 s; logs: $KWOK_WORKDIR/clusters/$name/logs" >&2
  return 1
}

apply_nodes() {
  # Nodes keep the status (capacity) they are created with; `apply` on an existing node is a no-op.
  kubectl apply -f "$here/kwok/nodes.yaml" -f "$here/kwok/h100-nodes.yaml" >/dev/null
  # A node kwok has not initialised yet has no conditions, which `kubectl wait` reports as an error
  # instead of waiting: try again for a while (kwok, watching only annotated nodes, took over 10 s
  # to initialise six new ones here).
  local _
  for _ in $(seq 1 30); do
    kubectl wait --for=condition=Ready node -l type=kwok --timeout=60s >/dev/null 2>&1 && return 0
    sleep 2
  done
  kubectl wait --for=condition=Ready node -l type=kwok --timeout=60s >/dev/null
}

# Decide whether this machine can run the real node: prints HOST_IP=<host side of its veth> and
# succeeds, or prints the reason and fails. Installs the Debian packages it needs as root.
node_plan() {
  local reason
  if ((EUID == 0)); then
    reason=$(ensure_debian_packages "the real node" iproute2 util-linux mount iptables socat openssl) || {
      echo "$reason"
      return 1
    }
  fi
  node_py plan
}

# Bring the real node up (or leave it up); on failure print why and tear it down. The kwok CPU node is
# tainted only while the real node is there, so without one every namespace still gets (fake) pods.
node_up() {
  local reason
  if reason=$(node_py up 2>&1); then
    kubectl taint node cpu-node-0 "$FAKE_CPU_TAINT" --overwrite >/dev/null
    node_py status
  else
    echo "cluster.sh: no real node: ${reason#node.py: }; the control plane runs without it" >&2
    node_py down >/dev/null 2>&1 || true
    kubectl taint node cpu-node-0 "${FAKE_CPU_TAINT%%=*}-" >/dev/null 2>&1 || true
  fi
}

# Namespaces whose pods all go to kwok's fake nodes (what the tests of operator behaviour and the
# DeepSeek demo use): a node selector for type=kwok and tolerations for the fake nodes' taints.
fake_namespace() {
  local ns manifest
  for ns in "$@"; do
    manifest=$(python3 - "$ns" "$here/kwok/fake-namespace-annotations.json" <<'PY'
import json, sys
annotations = json.load(open(sys.argv[2]))
print(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": sys.argv[1], "annotations": annotations}}))
PY
    )
    kubectl apply -f - <<<"$manifest" >/dev/null
  done
}

up() {
  "$here/build.sh"
  mkdir -p "$state"
  local start plan host_ip="" create_stamp
  start=$(date +%s)
  if plan=$(node_plan); then
    host_ip=$(sed -n 's/^HOST_IP=//p' <<<"$plan")
  else
    echo "cluster.sh: no real node: $plan; the control plane runs without it" >&2
  fi
  create_stamp=$(create_stamp_of "${host_ip:-none}")
  if exists && [[ "$(cat "$(stamp_file)" 2>/dev/null)" != "$create_stamp" ]]; then
    echo "cluster.sh: cluster '$name' was created with other settings; recreating it"
    node_py down >/dev/null 2>&1 || true
    kwokctl delete cluster >/dev/null 2>&1
  fi
  if exists; then
    cp "$(cluster_kubeconfig)" "$kubeconfig"
    if ! healthy; then
      # Processes gone (reboot, killed): restart them on the existing etcd data.
      echo "cluster.sh: restarting cluster '$name'"
      kwokctl start cluster >/dev/null
    fi
  else
    echo "cluster.sh: creating cluster '$name' (kube $KUBE_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION)"
    # kwokctl binds its components to 0.0.0.0; pin free ports and bind every listener to 127.0.0.1.
    local p pki="$KWOK_WORKDIR/clusters/$name/pki" node_args=() sans="$state/kwokctl-$name.yaml"
    read -r -a p <<<"$(free_ports 6)"
    # The apiserver stays on 127.0.0.1; the real node and its pods reach it on the host side of the
    # node's veth (node.py forwards that port there), so that address is the one it advertises (the
    # `kubernetes` Service's endpoint) and is in its certificate, with the Service's own 10.0.0.1 that
    # in-cluster clients verify against.
    if [[ -n "$host_ip" ]]; then
      printf '%s\n' "apiVersion: config.kwok.x-k8s.io/v1alpha1" "kind: KwokctlConfiguration" "options:" \
        "  kubeApiserverCertSANs: [\"10.0.0.1\", \"$host_ip\"]" >"$sans"
      node_args=(--config "$sans" --extra-args "kube-apiserver=advertise-address=$host_ip")
    fi
    # --kube-authorization turns on RBAC (and Node authorization) so the operator's least-privilege
    # role and the kubelet's node identity are really enforced.
    # Every component's first --extra-args must come before any second one: kwokctl v0.8.0 indexes
    # a repeated component's patch by its argument's position (an index out of range otherwise).
    # kwok fakes only the nodes annotated kwok.x-k8s.io/node=fake (kwokctl's default is every node,
    # the real one included); the apiserver reaches kubelets by their InternalIP with the admin
    # certificate (as kubeadm sets it up).
    kwokctl create cluster \
      --kube-authorization=true \
      --config "$here/kwok/stages.yaml" \
      --kube-audit-policy "$here/kwok/audit-policy.yaml" \
      --kubeconfig "" \
      --kube-apiserver-port "${p[0]}" --etcd-port "${p[1]}" --controller-port "${p[2]}" \
      --kube-controller-manager-port "${p[3]}" --kube-scheduler-port "${p[4]}" \
      --extra-args "kube-apiserver=bind-address=127.0.0.1" \
      --extra-args "kube-controller-manager=bind-address=127.0.0.1" \
      --extra-args "kube-scheduler=bind-address=127.0.0.1" \
      --extra-args "kwok-controller=server-address=127.0.0.1:${p[2]}" \
      --extra-args "etcd=listen-client-urls=http://127.0.0.1:${p[1]}" \
      --extra-args "etcd=listen-peer-urls=http://127.0.0.1:${p[5]}" \
      --extra-args "kwok-controller=cidr=$POD_CIDR" \
      --extra-args "kube-controller-manager=leader-elect=false" \
      --extra-args "kube-scheduler=leader-elect=false" \
      --extra-args "kube-apiserver=service-cluster-ip-range=$SERVICE_CIDR" \
      --extra-args "kube-apiserver=enable-admission-plugins=$ADMISSION_PLUGINS" \
      --extra-args "kube-apiserver=kubelet-client-certificate=$pki/admin.crt" \
      --extra-args "kube-apiserver=kubelet-client-key=$pki/admin.key" \
      --extra-args "kube-apiserver=kubelet-preferred-address-types=InternalIP,Hostname" \
      --extra-args "kwok-controller=manage-all-nodes=false" \
      --extra-args "kwok-controller=manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake" \
      "${node_args[@]}" \
      --wait 60s >"$state/create-$name.log" 2>&1 || {
      cat "$state/create-$name.log" >&2
      exit 1
    }
    echo "$create_stamp" >"$(stamp_file)"
    cp "$(cluster_kubeconfig)" "$kubeconfig"
  fi
  wait_ready
  apply_nodes
  "$here/lws.sh" up "$kubeconfig" "$state/$name"
  if [[ -n "$host_ip" ]]; then
    node_up
  else
    kubectl taint node cpu-node-0 "${FAKE_CPU_TAINT%%=*}-" >/dev/null 2>&1 || true
  fi
  echo "cluster.sh: cluster '$name' ready in $(($(date +%s) - start)) s; export KUBECONFIG=$kubeconfig"
}

down() {
  # The node first: its kubelet would otherwise keep restarting pods against a vanished apiserver.
  node_py down
  "$here/lws.sh" down "$state/$name"
  if exists; then
    kwokctl delete cluster >/dev/null 2>&1
  fi
  rm -f "$kubeconfig" "$state/kwokctl-$name.yaml"
  echo "cluster.sh: cluster '$name' deleted"
}

restart() {
  # Restart control-plane processes on their data (fault tests): etcd and/or kube-apiserver, both by
  # default. Clients' watches break and the apiserver's watch cache starts empty (watches resuming
  # from an older resourceVersion get 410 Gone). Only these two: a restarted kwok controller could
  # not manage the nodes until its predecessor's node leases expired (200 s).
  exists || {
    echo "cluster.sh: no cluster '$name' to restart" >&2
    exit 1
  }
  local pids="$KWOK_WORKDIR/clusters/$name/pids" component pid _
  local components=("$@")
  [[ ${#components[@]} -gt 0 ]] || components=(etcd kube-apiserver)
  for component in "${components[@]}"; do
    case "$component" in
    etcd | kube-apiserver) ;;
    *)
      echo "cluster.sh: restart takes etcd and/or kube-apiserver, got '$component'" >&2
      exit 2
      ;;
    esac
    pid=$(cat "$pids/$component.pid" 2>/dev/null || true)
    # SIGKILL: a crash, and no graceful shutdown still holding the port when the new one starts.
    if [[ -n "$pid" ]] && kill -KILL "$pid" 2>/dev/null; then
      for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
    fi
    rm -f "$pids/$component.pid"
  done
  # `start cluster` starts exactly the components whose pid file is missing.
  kwokctl start cluster >/dev/null 2>&1
  wait_ready
  echo "cluster.sh: restarted ${components[*]} of cluster '$name'"
}

rdma() {
  local gpu_nodes node
  gpu_nodes=$(kubectl get nodes -l nvidia.com/gpu.present=true -o name)
  for node in $gpu_nodes; do
    case "$1" in
    on)
      kubectl label "$node" feature.node.kubernetes.io/rdma.available=true --overwrite >/dev/null
      kubectl patch "$node" --subresource=status --type=merge -p \
        '{"status":{"capacity":{"rdma/rdma_shared_device_a":"1k"},"allocatable":{"rdma/rdma_shared_device_a":"1k"}}}' >/dev/null
      ;;
    off)
      kubectl label "$node" feature.node.kubernetes.io/rdma.available- >/dev/null
      kubectl patch "$node" --subresource=status --type=merge -p \
        '{"status":{"capacity":{"rdma/rdma_shared_device_a":null},"allocatable":{"rdma/rdma_shared_device_a":null}}}' >/dev/null
      ;;
    *)
      echo "cluster.sh: rdma takes 'on' or 'off', got '$1'" >&2
      exit 2
      ;;
    esac
  done
  echo "cluster.sh: RDMA $1 on $(echo "$gpu_nodes" | wc -w) GPU nodes"
}

status() {
  if ! healthy; then
    echo "down"
    exit 1
  fi
  echo "up: KUBECONFIG=$kubeconfig"
  node_py status 2>&1 || true
}

case "${1:-}" in
up) up ;;
down) down ;;
restart) restart "${@:2}" ;;
rdma) rdma "${2:-}" ;;
audit-log) echo "$KWOK_WORKDIR/clusters/$name/logs/audit.log" ;;
status) status ;;
real-node) node_py real-node ;;
import-image)
  [[ $# -ge 2 ]] || { echo "usage: cluster.sh import-image FILE.tar..." >&2; exit 2; }
  node_py import-image "${@:2}"
  ;;
has-image)
  [[ $# -ge 2 ]] || { echo "usage: cluster.sh has-image REF..." >&2; exit 2; }
  node_py has-image "${@:2}"
  ;;
fake-namespace)
  [[ $# -ge 2 ]] || { echo "usage: cluster.sh fake-namespace NAME..." >&2; exit 2; }
  fake_namespace "${@:2}"
  ;;
*)
  echo "usage: cluster.sh up|down|restart [etcd] [kube-apiserver]|status|real-node|import-image FILE...|has-image REF...|fake-namespace NAME...|audit-log|rdma on|off" >&2
  exit 2
  ;;
esac
