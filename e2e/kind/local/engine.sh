#!/usr/bin/env bash
# A Docker engine for the local kind path, when the machine has none running.
#
#   e2e/kind/local/engine.sh start   # Debian's docker.io (installed if missing, as root), state under
#                                    # .cache/kind/engine/, its own socket; prints DOCKER_HOST=...
#   e2e/kind/local/engine.sh stop    # stops the engine this script started (nothing else)
#   e2e/kind/local/engine.sh host    # prints the DOCKER_HOST of the engine this script runs, if up
#
# The engine's default runtime is runc behind runc-wrapper (see that file): privileged containers,
# which kind's nodes are, then start on machines whose root lacks a capability.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
state="$repo/.cache/kind/engine"
socket="$state/docker.sock"
pidfile="$state/dockerd.pid"
host="unix://$socket"
log() { printf 'engine.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

running() { [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

start() {
  if running && DOCKER_HOST="$host" docker info >/dev/null 2>&1; then
    echo "DOCKER_HOST=$host"
    return
  fi
  [[ "$(id -u)" == 0 ]] || die "starting a Docker engine needs root (or run one yourself and set DOCKER_HOST)"
  # jq: runc-wrapper edits the OCI spec with it.
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v jq >/dev/null || missing+=(jq)
  if [[ ${#missing[@]} -gt 0 ]]; then
    log "installing Debian's ${missing[*]}"
    mkdir -p "$repo/.cache/kind"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >"$repo/.cache/kind/apt-docker.log" 2>&1 ||
      die "apt-get install ${missing[*]} failed; see .cache/kind/apt-docker.log"
  fi
  command -v docker >/dev/null || die "no docker client on PATH"
  mkdir -p "$state/runtime"
  cp "$here/runc-wrapper" "$state/runtime/runc-wrapper"
  # The runc the local cluster built (the version its containerd is tested with), else the system's.
  real_runc="$repo/e2e/cluster/bin/runc"
  [[ -x "$real_runc" ]] || real_runc="$(command -v runc)" || die "no runc: build e2e/cluster (make tools) or install runc"
  ln -sf "$real_runc" "$state/runtime/runc"
  log "starting dockerd (state in ${state#"$repo"/})"
  nohup dockerd --data-root "$state/data" --exec-root "$state/exec" --pidfile "$pidfile" -H "$host" \
    --add-runtime "wrapped-runc=$state/runtime/runc-wrapper" --default-runtime wrapped-runc \
    >"$state/dockerd.log" 2>&1 &
  for _ in $(seq 120); do
    DOCKER_HOST="$host" docker info >/dev/null 2>&1 && { echo "DOCKER_HOST=$host"; return; }
    kill -0 $! 2>/dev/null || break
    sleep 0.5
  done
  tail -n 20 "$state/dockerd.log" >&2
  die "dockerd did not answer within 60 s; see ${state#"$repo"/}/dockerd.log"
}

stop() {
  running || return 0
  local pid
  pid="$(cat "$pidfile")"
  log "stopping dockerd ($pid)"
  kill "$pid"
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  host) running && echo "DOCKER_HOST=$host" ;;
  *) sed -n '2,10p' "$0" >&2; exit 2 ;;
esac
