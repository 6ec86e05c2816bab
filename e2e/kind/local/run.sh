#!/usr/bin/env bash
# make e2e-kind: the kind end-to-end path users run (e2e/kind/up.sh, then `up.sh test`), on this machine
# with no registry: a Docker engine (started here if none answers, stopped afterwards), kind and a node
# image built from pinned modules and Debian packages (build.sh), the runtime and operator images built
# here (make images-local) and loaded into the cluster.
#
#   e2e/kind/local/run.sh            # cluster, the tiny model answering through its router, the suite, down
#   e2e/kind/local/run.sh --no-test  # without `up.sh test`
#   e2e/kind/local/run.sh --keep     # leave the cluster (and the engine this script started) running
#
# Needs root, namespaces and cgroups (what the local cluster's real node needs), for a Docker engine.
# Where that cannot work it stops with the reason. Times of each phase are printed at the end.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
cd "$repo"
# shellcheck source=../../cluster/versions.env
source "$repo/e2e/cluster/versions.env"
# shellcheck source=versions.env
source "$here/versions.env"

run_tests=true
keep=false
for arg in "$@"; do
  case "$arg" in
    --no-test) run_tests=false ;;
    --keep) keep=true ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$arg' (expected --no-test or --keep)" >&2; exit 2 ;;
  esac
done
log() { printf 'e2e-kind: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# Where this cannot work, say why before building anything.
[[ "$(uname -s)" == Linux ]] || die "needs Linux (a Docker engine and kind nodes run here)"
[[ -d /sys/fs/cgroup ]] && [[ -n "$(ls -A /sys/fs/cgroup)" ]] || die "no cgroup filesystem at /sys/fs/cgroup"
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
  for controller in cpu memory pids; do
    grep -qw "$controller" /sys/fs/cgroup/cgroup.controllers ||
      die "cgroup v2 without the $controller controller: kind's nodes need cpu, memory and pids"
  done
fi

timings=()
phase_start=$(date +%s)
phase() {
  local now
  now=$(date +%s)
  timings+=("$1: $((now - phase_start)) s")
  phase_start=$now
}
started_engine=false
finish() {
  local status=$?
  if [[ "$keep" != true ]]; then
    e2e/kind/up.sh down || true
    if [[ "$started_engine" == true ]]; then e2e/kind/local/engine.sh stop || true; fi
  fi
  printf 'e2e-kind: %s\n' "${timings[@]}" >&2
  exit "$status"
}
trap finish EXIT

# 1. A Docker engine: the one DOCKER_HOST (or the default socket) names, else ours.
if ! docker info >/dev/null 2>&1; then
  engine="$(e2e/kind/local/engine.sh start)" || die "no Docker engine answers and none could be started"
  export "${engine?}"
  started_engine=true
fi
export PATH="$repo/.cache/kind/bin:$repo/e2e/cluster/bin:$PATH"
phase engine

# 2. kind, kubeadm, crictl and the node image.
e2e/kind/local/build.sh
phase "node image"

# 3. The runtime and operator images, loaded into the engine for up.sh's `kind load docker-image`.
make images-local
python3 - "$repo/.cache/images/images.json" <<'PY' | while read -r archive; do docker load -q -i "$archive" >/dev/null; done
import json, sys
for image in json.load(open(sys.argv[1]))["images"].values():
    print(image["archive"])
PY
phase "runtime and operator images"

# 4. The flow users run, with the images built here.
KIND_NODE_IMAGE="$NODE_IMAGE:$KUBE_VERSION" SKIP_BUILD=true e2e/kind/up.sh
phase "up.sh (cluster, chart, tiny answering)"
# 5. Fake GPUs and RDMA on the chosen workers (FAKE_GPU_NODES, default the last worker): labelled as
#    NVIDIA's GPU operator labels an H100 node, advertised by our device plugin; then the GPU example
#    (e2e/kind/gpu-tiny.yaml) must be scheduled there.
# The cluster up.sh made: its name and kubeconfig as up.sh derives them from the CPU config.
cluster="$(sed -n 's/^name: //p' "$repo/e2e/kind/kind-cpu.yaml")"
export KUBECONFIG="$repo/.cluster/kind-$cluster.kubeconfig"
read -r -a gpu_nodes <<<"${FAKE_GPU_NODES:-$(kind get nodes --name "$cluster" | grep -v -- '-control-plane[0-9]*$' | sort | tail -1)}"
[[ ${#gpu_nodes[@]} -gt 0 ]] || die "no worker to give fake GPUs (FAKE_GPU_NODES)"
kubectl label --overwrite node "${gpu_nodes[@]}" nvidia.com/gpu.present=true \
  nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3 nvidia.com/gpu.count=8 nvidia.com/gpu.memory=81559 \
  nvidia.com/gpu.family=hopper feature.node.kubernetes.io/rdma.available=true >/dev/null
sed "s|image: IMAGE|image: $FAKEGPU_IMAGE|" "$here/fakegpu.yaml" | kubectl apply -f - >/dev/null
kubectl -n kube-system rollout status daemonset/fakegpu --timeout=120s
for node in "${gpu_nodes[@]}"; do
  for _ in $(seq 60); do
    [[ "$(kubectl get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" == 8 ]] && break
    sleep 2
  done
  [[ "$(kubectl get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" == 8 ]] ||
    die "$node does not advertise nvidia.com/gpu: 8; kubectl -n kube-system logs daemonset/fakegpu"
done
log "fake GPUs on ${gpu_nodes[*]}: $(kubectl get node "${gpu_nodes[0]}" -o jsonpath='{.status.allocatable}')"
# The GPU example, scheduled by the real scheduler onto a fake GPU worker. Its pod cannot serve (no CUDA
# behind the fake devices), so this waits for PodScheduled, not Ready, and removes it again.
gpu_check_ns=fake-gpu-check
kubectl create namespace "$gpu_check_ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl -n "$gpu_check_ns" apply -f "$repo/e2e/kind/gpu-tiny.yaml" >/dev/null
gpu_pod_node=""
for _ in $(seq 90); do
  gpu_pod_node="$(kubectl -n "$gpu_check_ns" get pods -l app.kubernetes.io/component!=router \
    -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' 2>/dev/null | grep -m1 . || true)"
  [[ -n "$gpu_pod_node" ]] && break
  sleep 2
done
kubectl -n "$gpu_check_ns" get pods -o wide >&2 || true
[[ " ${gpu_nodes[*]} " == *" $gpu_pod_node "* ]] ||
  die "the GPU example's pod was not scheduled onto a fake GPU worker (got '${gpu_pod_node:-none}')"
log "the GPU example's pod was scheduled onto $gpu_pod_node"
kubectl delete namespace "$gpu_check_ns" --wait=false >/dev/null
phase "fake GPU nodes"

# 6. The default StorageClass (`standard`, which kind applies from the node image's default-storage.yaml,
#    build.sh's storage.yaml): its provisioner running, so that claims of the class bind.
kubectl -n local-path-storage rollout status deployment/local-path-provisioner --timeout=180s
default_class="$(kubectl get storageclass \
  -o jsonpath='{range .items[?(@.metadata.annotations.storageclass\.kubernetes\.io/is-default-class=="true")]}{.metadata.name} ({.provisioner}){end}')"
[[ "$default_class" == "standard (rancher.io/local-path)" ]] ||
  die "the default StorageClass is '${default_class:-none}', not standard (rancher.io/local-path); kubectl get storageclass"
log "default StorageClass $default_class"
phase "default StorageClass"

# 7. LeaderWorkerSet, for multi-node replicas (nodesPerReplica > 1): upstream's manifests from the module
#    e2e/cluster/lws pins, with the controller image built into the node image (lws_manifests.py).
read -r lws_dir lws_version < <(cd "$repo/e2e/cluster/lws" && go list -m -f '{{.Dir}} {{.Version}}' sigs.k8s.io/lws)
kubectl kustomize "$lws_dir/config/default" | "$repo/.venv/bin/python" "$here/lws_manifests.py" "$LWS_IMAGE" |
  kubectl apply --server-side --force-conflicts -f - >/dev/null
kubectl -n lws-system rollout status deployment/lws-controller-manager --timeout=180s
# The controller writes its webhooks' CA bundle once its certificate exists; until then a
# LeaderWorkerSet cannot be created.
lws_ca_bundle() {
  kubectl get validatingwebhookconfiguration lws-validating-webhook-configuration \
    -o jsonpath='{.webhooks[0].clientConfig.caBundle}'
}
for _ in $(seq 90); do
  [[ -n "$(lws_ca_bundle)" ]] && break
  sleep 2
done
[[ -n "$(lws_ca_bundle)" ]] ||
  die "LeaderWorkerSet's webhooks got no CA bundle; kubectl -n lws-system logs deployment/lws-controller-manager"
log "LeaderWorkerSet $lws_version running"
phase "LeaderWorkerSet"

if [[ "$run_tests" == true ]]; then
  e2e/kind/up.sh test
  phase "up.sh test"
fi
log "done"
