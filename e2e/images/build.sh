#!/usr/bin/env bash
# Builds the runtime and operator images on this machine, without a registry or a Docker engine:
# a Debian base root filesystem from Debian's packages (debootstrap), the Python packages copied from
# the project's .venv (nothing downloaded again), the project from a wheel of the working tree.
# Archives (OCI layout + docker save) and images.json go to .cache/images/. See e2e/images/build.py.
#
# Every layer is cached by a key of its inputs, so a second run with nothing changed is a no-op and
# a code change rebuilds only the small top layer. Niced: CI machines are small and shared.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
if [[ ! -x "$python" ]]; then
  echo "build.sh: $python not found: run 'make venv' first (the images copy its packages)" >&2
  exit 1
fi
exec nice -n 10 "$python" "$here/build.py" "$@"
