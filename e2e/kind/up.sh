#!/usr/bin/env bash
# Sovereign on kind, end to end, for machines with Docker (and optionally NVIDIA GPUs):
# create the cluster, build and load the images, install the chart, deploy the tiny model (and a
# GPU one with --gpu), wait for Ready and send one chat completion through the router.
#
#   e2e/kind/up.sh            # CPU-only cluster, examples/tiny.yaml
#   e2e/kind/up.sh --gpu      # GPU worker via the NVIDIA container toolkit + device plugin
#   e2e/kind/up.sh test       # the cluster suite against it (add --gpu for the GPU cluster)
#   e2e/kind/up.sh down       # delete the cluster(s)
#
# `test` runs the same end-to-end suite as `make test` runs on the local control plane, with the
# chart's operator instead of one the tests start (SOVEREIGN_TEST_OPERATOR=external). Tests that
# need kwok's fake 8x H200 nodes or a local operator process are skipped there, each with its reason.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"

gpu=false
action=up
for arg in "$@"; do
  case "$arg" in
    --gpu) gpu=true ;;
    --cpu) gpu=false ;;
    down) action=down ;;
    test) action="test" ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "up.sh: unknown argument '$arg' (expected --gpu, --cpu, test or down)" >&2; exit 2 ;;
  esac
done

namespace="${SOVEREIGN_NAMESPACE:-sovereign-system}"
models_ns="${MODELS_NAMESPACE:-default}"
image_repo="${IMAGE_REPO:-ghcr.io/sovereign-ai}"
image_tag="${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}"
device_plugin_version="${NVIDIA_DEVICE_PLUGIN_VERSION:-0.17.1}"
ready_timeout="${READY_TIMEOUT:-900s}"

log() { printf 'up.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

if [[ "$gpu" == true ]]; then
  config="$here/kind-gpu.yaml"
else
  config="$here/kind-cpu.yaml"
fi
cluster="$(sed -n 's/^name: //p' "$config")"
kubeconfig="$repo/.cluster/kind-$cluster.kubeconfig"

if [[ "$action" == down ]]; then
  for c in sovereign-cpu sovereign-gpu; do
    if kind get clusters 2>/dev/null | grep -qx "$c"; then kind delete cluster --name "$c"; fi
  done
  exit 0
fi

if [[ "$action" == test ]]; then
  [[ -f "$kubeconfig" ]] || die "no kubeconfig for kind cluster $cluster; run e2e/kind/up.sh first"
  make venv
  KUBECONFIG="$kubeconfig" SOVEREIGN_TEST_OPERATOR=external SOVEREIGN_OPERATOR_NAMESPACE="$namespace" \
    SOVEREIGN_OPERATOR_SELECTOR="app.kubernetes.io/name=sovereign,app.kubernetes.io/instance=sovereign" \
    exec .venv/bin/pytest -m cluster tests/cluster tests/packaging/test_chart_install.py
fi

for tool in docker kind kubectl helm curl; do
  command -v "$tool" >/dev/null || die "'$tool' is required on PATH"
done
docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info failed)"

# 1. Cluster.
mkdir -p "$repo/.cluster"
if ! kind get clusters 2>/dev/null | grep -qx "$cluster"; then
  log "creating kind cluster $cluster from ${config#"$repo"/}"
  # KIND_NODE_IMAGE: a node image other than kind's default (make e2e-kind builds one here).
  kind create cluster --config "$config" --kubeconfig "$kubeconfig" --wait 120s \
    ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
else
  kind get kubeconfig --name "$cluster" >"$kubeconfig"
fi
export KUBECONFIG="$kubeconfig"

# 2. GPUs: the toolkit inside each GPU node, containerd's default runtime set to nvidia, then the
#    device plugin, which advertises nvidia.com/gpu.
if [[ "$gpu" == true ]]; then
  command -v nvidia-smi >/dev/null || die "--gpu needs the NVIDIA driver on the host (nvidia-smi)"
  for node in $(kind get nodes --name "$cluster"); do
    docker exec "$node" test -e /var/run/nvidia-container-devices/all || continue
    if ! docker exec "$node" command -v nvidia-ctk >/dev/null 2>&1; then
      log "installing the NVIDIA container toolkit in $node"
      docker exec "$node" bash -c '
        set -euo pipefail
        apt-get update -qq && apt-get install -y -qq curl gpg >/dev/null
        curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey |
          gpg --dearmor -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
        curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list |
          sed "s#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] https://#" \
          >/etc/apt/sources.list.d/nvidia-container-toolkit.list
        apt-get update -qq && apt-get install -y -qq nvidia-container-toolkit >/dev/null'
    fi
    docker exec "$node" nvidia-ctk runtime configure --runtime=containerd --set-as-default
    docker exec "$node" systemctl restart containerd
  done
  helm repo add nvdp https://nvidia.github.io/k8s-device-plugin >/dev/null
  helm repo update nvdp >/dev/null
  helm upgrade --install nvidia-device-plugin nvdp/nvidia-device-plugin \
    --namespace nvidia-device-plugin --create-namespace --version "$device_plugin_version" --wait
  log "waiting for a node to advertise nvidia.com/gpu"
  for _ in $(seq 60); do
    gpus="$(kubectl get nodes -o jsonpath='{range .items[*]}{.status.allocatable.nvidia\.com/gpu}{"\n"}{end}' | grep -c '[1-9]' || true)"
    [[ "$gpus" -gt 0 ]] && break
    sleep 5
  done
  [[ "${gpus:-0}" -gt 0 ]] || die "no node advertises nvidia.com/gpu; check the device plugin's logs"
fi

# 3. Images: build here, load into every node (no registry needed; pullPolicy IfNotPresent).
operator_image="$image_repo/sovereign-operator:$image_tag"
runtime_image="$image_repo/sovereign-runtime:$image_tag"
if [[ "${SKIP_BUILD:-false}" != true ]]; then
  make images IMAGE_REPO="$image_repo" IMAGE_TAG="$image_tag"
fi
# Into the workers only: the control plane is tainted against these pods, and each node's copy of the
# runtime image costs minutes and gigabytes.
workers="$(kind get nodes --name "$cluster" | grep -v -- '-control-plane[0-9]*$' | paste -sd, -)"
[[ -n "$workers" ]] || die "kind cluster $cluster has no worker node"
kind load docker-image --name "$cluster" --nodes "$workers" "$operator_image" "$runtime_image"

# 4. The chart (CRDs, operator, RBAC).
helm upgrade --install sovereign "$repo/charts/sovereign" \
  --namespace "$namespace" --create-namespace \
  --set image.repository="$image_repo/sovereign-operator" --set image.tag="$image_tag" \
  --set runtimeImage.repository="$image_repo/sovereign-runtime" --set runtimeImage.tag="$image_tag" \
  --wait --timeout 5m
kubectl wait --for=condition=Established crd/llmdeployments.sovereign.ai --timeout=60s

# 5. Models. The runtime image tag loaded above is what the LLMDeployments run.
models=("$repo/examples/tiny.yaml")
if [[ "$gpu" == true ]]; then models+=("$here/gpu-tiny.yaml"); fi
names=()
for manifest in "${models[@]}"; do
  kubectl apply -n "$models_ns" -f "$manifest"
  names+=("$(kubectl apply -n "$models_ns" -f "$manifest" --dry-run=client -o jsonpath='{.metadata.name}')")
done
for name in "${names[@]}"; do
  kubectl -n "$models_ns" patch llmdeployment "$name" --type merge \
    -p "{\"spec\":{\"runtime\":{\"image\":\"$runtime_image\"}}}" >/dev/null
done

# 6. Ready, then one chat completion through each router.
for name in "${names[@]}"; do
  log "waiting up to $ready_timeout for llmdeployment/$name to be Ready"
  if ! kubectl -n "$models_ns" wait --for=condition=Ready "llmdeployment/$name" --timeout="$ready_timeout"; then
    kubectl -n "$models_ns" describe llmdeployment "$name" >&2
    die "llmdeployment/$name did not become Ready"
  fi
  port=$((18000 + RANDOM % 1000))
  kubectl -n "$models_ns" port-forward "service/$name" "$port:8000" >/dev/null 2>&1 &
  forward=$!
  # shellcheck disable=SC2064  # expand now: each router has its own port-forward
  trap "kill $forward 2>/dev/null || true" EXIT
  for _ in $(seq 30); do
    curl -fsS "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && break
    sleep 1
  done
  model="$(kubectl -n "$models_ns" get llmdeployment "$name" -o jsonpath='{.spec.model.name}')"
  reply="$(curl -fsS "http://127.0.0.1:$port/v1/chat/completions" \
    -H 'Content-Type: application/json' \
    -d "{\"model\":\"$model\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}],\"max_tokens\":16}")"
  kill "$forward" 2>/dev/null || true
  trap - EXIT
  grep -q '"choices"' <<<"$reply" || die "unexpected reply from $name: $reply"
  log "$name answered: $reply"
done

log "done. KUBECONFIG=$kubeconfig"
