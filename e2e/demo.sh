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
ns=demo         # examples/tiny.yaml goes here
ds_ns=llm      # examples/deepseek-v3-pd.yaml names this namespace itself
timeout_s="${SOVEREIGN_DEMO_TIMEOUT:-240}"

kubectl() { "$bin/kubectl" --kubeconfig "$kubeconfig" "$@"; }

operator_running() { [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

stop() {
  if operator_running; then
    kill "$(cat "$pidfile")"
    echo "demo: operator stopped"
  fi
  rm -f "$pidfile"
  "$repo/e2e/cluster/cluster.sh" down
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
  local runtime_image why=""
  runtime_image=$("$repo/.venv/bin/python" -c 'from sovereign_operator.api.spec import DEFAULT_RUNTIME_IMAGE as i; print(i)')
  if ! why=$("$repo/e2e/cluster/cluster.sh" has-image "$runtime_image" 2>&1); then
    "$repo/e2e/cluster/cluster.sh" fake-namespace "$ns"
    echo "demo: the tiny example runs on kwok's fake CPU node (${why#node.py: })"
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
  local start last="" table
  start=$(date +%s)
  while true; do
    table=$(kubectl get llmd -A -o wide 2>&1 || true)
    if [[ "$table" != "$last" ]]; then
      printf '\n[%3ss]\n%s\n' "$(($(date +%s) - start))" "$table"
      last="$table"
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

  ask_the_model

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
