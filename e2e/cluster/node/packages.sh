# shellcheck shell=bash
# Debian packages the local cluster's real node needs, installed on demand (sourced by build.sh and
# cluster.sh).

# ensure_debian_packages WHAT PACKAGE...: succeed when every package is installed, installing the
# missing ones with apt-get as root. Otherwise print one line naming WHAT, the missing packages and
# why they cannot be installed, and fail.
ensure_debian_packages() {
  local what="$1" missing=() p
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  if ! command -v apt-get >/dev/null; then
    echo "$what needs the Debian packages ${missing[*]}, and this machine has no apt-get"
    return 1
  fi
  if ((EUID != 0)); then
    echo "$what needs the Debian packages ${missing[*]}: run 'apt-get install ${missing[*]}' as root (this is uid $EUID)"
    return 1
  fi
  echo "installing Debian packages for $what: ${missing[*]}" >&2
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -q)
  if "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >&2; then
    return 0
  fi
  # A stale package index is the usual cause on a fresh machine.
  if "${apt[@]}" update >&2 && "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >&2; then
    return 0
  fi
  echo "$what needs the Debian packages ${missing[*]}, and apt-get could not install them"
  return 1
}
