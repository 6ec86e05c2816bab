#!/usr/bin/env bash
# LeaderWorkerSet on the local control plane: the real controller of sigs.k8s.io/lws (the version
# lws/go.mod pins), built from its Go module, with its CRDs, running as a host process next to the
# control plane and serving its admission webhooks on 127.0.0.1 with a certificate made here.
#
#   lws.sh build                    bin/lws/lws-controller and bin/lws/crds/ (a stamp makes a rerun a no-op)
#   lws.sh up KUBECONFIG STATE_DIR  install the CRDs, start the controller (or keep the running one),
#                                   register its webhooks
#   lws.sh down STATE_DIR           stop the controller this state directory started
#
# Called by cluster.sh up/down. The controller runs with the admin kubeconfig, without leader election,
# metrics or a health port (nothing scrapes them here); its log is STATE_DIR/lws/controller.log.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/bin/lws"

build() {
  local stamp version dir start
  stamp="$out/.stamp-$(cat "$here/lws/go.mod" "$here/lws/go.sum" "$here/lws.sh" | sha1sum | cut -c1-16)"
  if [[ -f "$stamp" && -x "$out/lws-controller" && -d "$out/crds" ]]; then
    return 0
  fi
  command -v go >/dev/null || { echo "lws.sh: 'go' is required to build the LeaderWorkerSet controller" >&2; exit 1; }
  version=$(awk '$1 == "sigs.k8s.io/lws" {print $2}' "$here/lws/go.mod")
  echo "lws.sh: LeaderWorkerSet controller $version"
  start=$(date +%s)
  mkdir -p "$out"
  rm -f "$out"/.stamp-*
  (cd "$here/lws" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false nice -n 10 go build -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$version" -o "$out/lws-controller" sigs.k8s.io/lws/cmd)
  dir=$(cd "$here/lws" && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)
  rm -rf "$out/crds"
  mkdir -p "$out/crds"
  cp "$dir"/config/crd/bases/*.yaml "$out/crds/"
  chmod u+w "$out"/crds/*.yaml
  touch "$stamp"
  echo "lws.sh: built in $(($(date +%s) - start)) s into $out"
}

running() {  # the controller this state directory started is alive
  local pid
  pid=$(cat "$1/controller.pid" 2>/dev/null) || return 1
  [[ -n "$pid" ]] && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q "lws-controller"
}

certs() {  # a CA and a serving certificate for 127.0.0.1, made once per state directory
  local dir="$1/certs"
  [[ -f "$dir/tls.crt" && -f "$dir/tls.key" && -f "$dir/ca.crt" ]] && return 0
  mkdir -p "$dir"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=lws-local-ca" \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=lws-webhook" \
    -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >"$dir/ext.cnf"
  openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 3650 -extfile "$dir/ext.cnf" -out "$dir/tls.crt" 2>/dev/null
}

up() {
  local kubeconfig="$1" state="$2/lws" port _
  build
  mkdir -p "$state"
  kubectl() { "$here/bin/kubectl" --kubeconfig "$kubeconfig" "$@"; }
  # Server-side: the CRDs are larger than a client-side apply's last-applied annotation may be.
  kubectl apply --server-side --force-conflicts -f "$out/crds/" >/dev/null
  # Right after the create the CRD may have no status.conditions yet, which `kubectl wait` reports as an
  # error instead of waiting (a fresh cluster's `up` failed on it): try again for a while.
  for _ in $(seq 1 30); do
    kubectl wait --for=condition=Established crd/leaderworkersets.leaderworkerset.x-k8s.io --timeout=60s \
      >/dev/null 2>&1 && break
    sleep 1
  done
  kubectl wait --for=condition=Established crd/leaderworkersets.leaderworkerset.x-k8s.io --timeout=60s >/dev/null
  certs "$state"
  if ! running "$state"; then
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    cat >"$state/config.yaml" <<YAML
apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection: {leaderElect: false}
internalCertManagement: {enable: false}
webhook: {host: 127.0.0.1, port: $port, certDir: $state/certs}
metrics: {bindAddress: "0"}
health: {healthProbeBindAddress: "0"}
YAML
    echo "$port" >"$state/port"
    KUBECONFIG="$kubeconfig" nohup "$out/lws-controller" --config "$state/config.yaml" \
      >"$state/controller.log" 2>&1 </dev/null &
    echo $! >"$state/controller.pid"
  fi
  port=$(cat "$state/port")
  for _ in $(seq 1 120); do
    curl -s --cacert "$state/certs/ca.crt" -o /dev/null "https://127.0.0.1:$port/" && break
    running "$state" || { echo "lws.sh: the controller exited; log: $state/controller.log" >&2; tail -5 "$state/controller.log" >&2; exit 1; }
    sleep 0.5
  done
  sed -e "s|URL_BASE|https://127.0.0.1:$port|" -e "s|CA_BUNDLE|$(base64 -w0 <"$state/certs/ca.crt")|" \
    "$here/lws/webhooks.yaml" | kubectl apply -f - >/dev/null
  echo "lws.sh: LeaderWorkerSet controller up (webhooks on 127.0.0.1:$port, log $state/controller.log)"
}

down() {
  local state="$1/lws" pid _
  if running "$state"; then
    pid=$(cat "$state/controller.pid")
    kill "$pid"
    for _ in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  fi
  rm -f "$state/controller.pid"
}

case "${1:-}" in
build) build ;;
up) up "${2:?KUBECONFIG}" "${3:?STATE_DIR}" ;;
down) down "${2:?STATE_DIR}" ;;
*)
  echo "usage: lws.sh build | up KUBECONFIG STATE_DIR | down STATE_DIR" >&2
  exit 2
  ;;
esac
