#!/usr/bin/env bash
# `make demo`: the local control plane, the CRDs, the operator and the examples, end to end.
#
#   e2e/demo.sh        build what is missing, start everything, show the examples reaching Ready
#   e2e/demo.sh stop   stop the operator and delete the cluster
#
# The operator runs in the background as a plain process (log: .cluster/demo-operator.log).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
state="$repo/.cluster"
bin="$repo/e2e/cluster/bin"
# SOVEREIGN_CLUSTER selects another local cluster, as for cluster.sh.
suffix=""
[[ "${SOVEREIGN_CLUSTER:-sovereign}" == sovereign ]] || suffix="-$SOVEREIGN_CLUSTER"
kubeconfig="$state/kubeconfig$suffix"
pidfile="$state/demo-operator$suffix.pid"
oplog="$state/demo-operator$suffix.log"
pf_pidfile="$state/demo-port-forward$suffix.pid"
pf_log="$state/demo-port-forward$suffix.log"
ns=demo         # examples/tiny.yaml goes here
ds_ns=llm      # examples/deepseek-v3-pd.yaml names this namespace itself
timeout_s="${SOVEREIGN_DEMO_TIMEOUT:-240}"

kubectl() { "$bin/kubectl" --kubeconfig "$kubeconfig" "$@"; }

operator_running() { [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

stop_port_forward() {
  if [[ -f "$pf_pidfile" ]] && kill -0 "$(cat "$pf_pidfile")" 2>/dev/null; then
    kill "$(cat "$pf_pidfile")"
  fi
  rm -f "$pf_pidfile"
}

stop() {
  stop_port_forward
  if operator_running; then
    kill "$(cat "$pidfile")"
    echo "demo: operator stopped"
  fi
  rm -f "$pidfile"
  "$repo/e2e/cluster/cluster.sh" down
}

# The runtime image on the real node: built here (e2e/images/build.sh, cached; the first build takes
# a few minutes) and imported (cluster.sh import-image, a no-op when the node holds it). Prints why not.
runtime_image_on_real_node() {
  local image=$1 node archive
  if ! node=$("$repo/e2e/cluster/cluster.sh" real-node 2>&1); then
    echo "no real node: ${node#node.py: }"
    return 1
  fi
  "$repo/e2e/cluster/cluster.sh" has-image "$image" >/dev/null 2>&1 && return 0
  if [[ $(id -u) != 0 ]]; then
    echo "building the runtime image needs root (debootstrap, chroot)"
    return 1
  fi
  echo "demo: building the runtime image (make images-local; cached after the first build)" >&2
  if ! "$repo/e2e/images/build.sh" --image runtime >&2; then
    echo "the runtime image's build failed (output above)"
    return 1
  fi
  archive=$("$repo/.venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["images"]["runtime"]["archive"])' \
    "$repo/.cache/images/images.json")
  echo "demo: importing $archive into $node" >&2
  "$repo/e2e/cluster/cluster.sh" import-image "$archive" >&2 || { echo "the import failed (output above)"; return 1; }
}

# On the real node the answers come from the pod, through the LLMDeployment's endpoint (the router
# Service), port-forwarded to 127.0.0.1 in the background so a person can curl it too.
ask_the_endpoint() {
  local endpoint service port local_port model
  endpoint=$(kubectl get llmd -n "$ns" tiny -o jsonpath='{.status.endpoint}')
  model=$(kubectl get llmd -n "$ns" tiny -o jsonpath='{.spec.model.name}')
  service=${endpoint#http://}
  service=${service%%.*}
  port=${endpoint##*:}
  port=${port%%/*}
  stop_port_forward
  local_port=${SOVEREIGN_DEMO_PORT:-$("$repo/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
  nohup "$bin/kubectl" --kubeconfig "$kubeconfig" port-forward -n "$ns" "service/$service" \
    "$local_port:$port" --address 127.0.0.1 >"$pf_log" 2>&1 &
  echo $! >"$pf_pidfile"
  for _ in $(seq 1 30); do
    grep -q "Forwarding from" "$pf_log" 2>/dev/null && break
    kill -0 "$(cat "$pf_pidfile")" 2>/dev/null || { echo "demo: port-forward exited: $(cat "$pf_log")" >&2; exit 1; }
    sleep 0.5
  done
  echo
  echo "demo: the built-in model, answering from the tiny pod on the real node through status.endpoint"
  echo "demo:   $endpoint  (service/$service, port-forwarded to http://127.0.0.1:$local_port)"
  "$repo/.venv/bin/python" "$repo/e2e/demo_ask.py" --endpoint "http://127.0.0.1:$local_port" "$model"
  cat <<EOF

Ask it yourself (the port-forward runs until 'make demo-stop'):
  curl -s http://127.0.0.1:$local_port/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$model", "messages": [{"role": "user", "content": "What is 17 + 25?"}], "max_tokens": 32}'
EOF
}

# kwok's pods run no containers: run the tiny pool's container here, with the arguments the operator
# rendered into its StatefulSet, and ask the built-in model (an answer can be checked, not just received).
ask_the_model() {
  local args
  args=$(kubectl get statefulset -n "$ns" tiny-unified -o jsonpath='{.spec.template.spec.containers[0].args}')
  echo
  echo "demo: the built-in model, served with the tiny pool's rendered container command:"
  "$repo/.venv/bin/python" "$repo/e2e/demo_ask.py" "$args"
}

start() {
  "$repo/e2e/cluster/build.sh"
  "$repo/e2e/cluster/cluster.sh" up
  echo "demo: installing the CRDs"
  kubectl apply --server-side --force-conflicts -f "$repo/crds" >/dev/null
  kubectl wait --for=condition=Established crd --all --timeout=60s >/dev/null

  if operator_running; then
    echo "demo: operator already running (pid $(cat "$pidfile"))"
  else
    echo "demo: starting the operator (log: $oplog)"
    # It watches only the demo's namespaces and serves no health port, so it cannot collide with
    # test sessions on the same cluster or machine.
    KUBECONFIG="$kubeconfig" nohup "$repo/.venv/bin/sovereign-operator" run --health-port 0 \
      --namespace "$ns" --namespace "$ds_ns" >>"$oplog" 2>&1 &
    echo $! >"$pidfile"
    sleep 2
    operator_running || { echo "demo: the operator exited; last lines of $oplog:" >&2; tail -20 "$oplog" >&2; exit 1; }
  fi

  # The DeepSeek example needs GPUs: its namespace sends every pod to kwok's fake nodes. The tiny
  # example runs on the real node when it is up and holds the runtime image; else on the fake CPU node.
  "$repo/e2e/cluster/cluster.sh" fake-namespace "$ds_ns"
  local runtime_image why="" real=0
  runtime_image=$("$repo/.venv/bin/python" -c 'from sovereign_operator.api.spec import DEFAULT_RUNTIME_IMAGE as i; print(i)')
  if [[ "${SOVEREIGN_DEMO_REAL_NODE:-1}" == 0 ]]; then
    why="SOVEREIGN_DEMO_REAL_NODE=0"
  elif why=$(runtime_image_on_real_node "$runtime_image"); then
    real=1
  fi
  if ((real == 0)); then
    "$repo/e2e/cluster/cluster.sh" fake-namespace "$ns"
    echo "demo: the tiny example runs on kwok's fake CPU node ($why); its answers come from a process started here"
  else
    kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
    kubectl annotate namespace "$ns" scheduler.alpha.kubernetes.io/node-selector- \
      scheduler.alpha.kubernetes.io/defaultTolerations- >/dev/null
    echo "demo: the tiny example runs on the real node ($runtime_image)"
  fi
  echo "demo: kubectl apply -n $ns -f examples/tiny.yaml"
  kubectl apply -n "$ns" -f "$repo/examples/tiny.yaml" >/dev/null
  echo "demo: kubectl apply -f examples/deepseek-v3-pd.yaml (+ its PVCs: e2e/demo/deepseek-volumes.yaml)"
  kubectl apply -f "$repo/e2e/demo/deepseek-volumes.yaml" >/dev/null
  kubectl apply -f "$repo/examples/deepseek-v3-pd.yaml" >/dev/null

  echo "demo: waiting for the LLMDeployments to become Ready (kwok starts fake pods in a few seconds)"
  local start last="" table progress last_progress=""
  start=$(date +%s)
  while true; do
    table=$(kubectl get llmd -A -o wide 2>&1 || true)
    if [[ "$table" != "$last" ]]; then
      printf '\n[%3ss]\n%s\n' "$(($(date +%s) - start))" "$table"
      last="$table"
    fi
    # A real pod's startup phases (loading_weights, compiling, ...) as the operator reads them.
    if ((real == 1)); then
      progress=$(kubectl get llmd -n "$ns" tiny -o jsonpath='{.status.conditions[?(@.type=="Progressing")].message}' 2>/dev/null || true)
      if [[ -n "$progress" && "$progress" != "$last_progress" ]]; then
        printf '[%3ss] tiny: %s\n' "$(($(date +%s) - start))" "$progress"
        last_progress="$progress"
      fi
    fi
    if kubectl wait --for=condition=Ready llmd --all -n "$ns" --timeout=1s >/dev/null 2>&1 &&
      kubectl wait --for=condition=Ready llmd --all -n "$ds_ns" --timeout=1s >/dev/null 2>&1; then
      break
    fi
    if (($(date +%s) - start > timeout_s)); then
      echo "demo: not Ready after ${timeout_s} s; see $oplog and 'kubectl describe llmd -A'" >&2
      exit 1
    fi
    operator_running || { echo "demo: the operator exited; see $oplog" >&2; exit 1; }
    sleep 2
  done

  if ((real == 1)); then
    ask_the_endpoint
  else
    ask_the_model
  fi

  cat <<EOF

demo: every LLMDeployment is Ready.

Explore (a real apiserver, scheduler and controller manager; kwok fakes the GPU nodes and pods):
  export KUBECONFIG=$kubeconfig
  e2e/cluster/bin/kubectl get llmd -A -o wide
  e2e/cluster/bin/kubectl describe llmd -n $ds_ns deepseek-v3
  e2e/cluster/bin/kubectl get statefulsets,services,deployments,pods -n $ds_ns -o wide
  e2e/cluster/bin/kubectl get nodes -L nvidia.com/gpu.product
  tail -f $oplog
Change something and watch it converge:
  e2e/cluster/bin/kubectl edit llmd -n $ns tiny          (e.g. decode.replicas: 3)
Stop everything:
  make demo-stop     (operator and cluster; 'make cluster-down' removes only the cluster)
EOF
}

case "${1:-start}" in
start) start ;;
stop) stop ;;
*)
  echo "usage: demo.sh [start|stop]" >&2
  exit 2
  ;;
esac
