#!/usr/bin/env bash
# The local control plane: real etcd, kube-apiserver, kube-controller-manager and kube-scheduler
# (built by build.sh) run by `kwokctl --runtime binary`, with kwok faking the nodes and pod lifecycle,
# and LeaderWorkerSet's controller next to them (lws.sh).
#
#   cluster.sh up         create (or reuse, or restart) the cluster; kubeconfig -> .cluster/kubeconfig
#   cluster.sh down       delete it
#   cluster.sh restart [etcd] [kube-apiserver]  restart those on their data (fault tests; both by default)
#   cluster.sh rdma on|off  give the GPU nodes the RDMA device-plugin resource, or take it away
#   cluster.sh status     is it up?
#   cluster.sh audit-log  path of the apiserver's audit log of writes (kwok/audit-policy.yaml)
#
# Environment: SOVEREIGN_CLUSTER (cluster name, default "sovereign"), SOVEREIGN_CLUSTER_DIR (state,
# default <repo>/.cluster). Everything runs as plain processes of the current user on 127.0.0.1.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin="$here/bin"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$here/versions.env"

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
# One controller-manager and one scheduler: without leader election they survive an etcd or
# apiserver restart (`restart`), where a lost lease would make them exit.
# What `create` was given that an existing cluster must match; a mismatch recreates it.
create_stamp="pod-cidr=$POD_CIDR service-cidr=$SERVICE_CIDR leader-elect=false audit=$(sha256sum "$here/kwok/audit-policy.yaml" | cut -c1-12)"
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
  # instead of waiting: try again for a while.
  local _
  for _ in 1 2 3 4 5; do
    kubectl wait --for=condition=Ready node --all --timeout=60s >/dev/null 2>&1 && return 0
    sleep 2
  done
  kubectl wait --for=condition=Ready node --all --timeout=60s >/dev/null
}

up() {
  "$here/build.sh"
  mkdir -p "$state"
  local start
  start=$(date +%s)
  if exists && [[ "$(cat "$(stamp_file)" 2>/dev/null)" != "$create_stamp" ]]; then
    echo "cluster.sh: cluster '$name' was created with other settings; recreating it"
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
    local p
    read -r -a p <<<"$(free_ports 6)"
    # --kube-authorization turns on RBAC so the operator's least-privilege role is really enforced.
    # Every component's first --extra-args must come before any second one: kwokctl v0.8.0 indexes
    # a repeated component's patch by its argument's position (an index out of range otherwise).
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
  echo "cluster.sh: cluster '$name' ready in $(($(date +%s) - start)) s; export KUBECONFIG=$kubeconfig"
}

down() {
  "$here/lws.sh" down "$state/$name"
  if exists; then
    kwokctl delete cluster >/dev/null 2>&1
  fi
  rm -f "$kubeconfig"
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

case "${1:-}" in
up) up ;;
down) down ;;
restart) restart "${@:2}" ;;
rdma) rdma "${2:-}" ;;
audit-log) echo "$KWOK_WORKDIR/clusters/$name/logs/audit.log" ;;
status) if healthy; then echo "up: KUBECONFIG=$kubeconfig"; else echo "down"; exit 1; fi ;;
*)
  echo "usage: cluster.sh up|down|restart [etcd] [kube-apiserver]|status|audit-log|rdma on|off" >&2
  exit 2
  ;;
esac
