#!/usr/bin/env bash
# Builds the local control plane's binaries into e2e/cluster/bin/ from pinned upstream Go modules:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, kwokctl, helm and
# kubeconform. Nothing is downloaded except Go modules through the module proxy.
#
# A stamp (hash of versions.env and the go.mod/go.sum files) makes a second run a no-op; changing a
# pin rebuilds everything. Go builds run one at a time and niced: CI machines are small and shared.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$here/bin"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$here/versions.env"

stamp_of() {
  cat "$here/versions.env" "$here"/kube/go.mod "$here"/kube/go.sum "$here"/etcd/go.mod \
    "$here"/etcd/go.sum "$here/build.sh" | sha1sum | cut -c1-16
}
stamp="$bin/.stamp-$(stamp_of)"
tools=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kwokctl helm kubeconform)

all_present() {
  local t
  for t in "${tools[@]}"; do [[ -x "$bin/$t" ]] || return 1; done
}

if [[ -f "$stamp" ]] && all_present; then
  exit 0
fi

command -v go >/dev/null || { echo "build.sh: 'go' is required to build the control plane" >&2; exit 1; }

# The kube module's go.mod must require the version that versions.env names (it is stamped below).
if ! grep -Eq "^\s*k8s.io/kubernetes $KUBE_VERSION( |$)" "$here/kube/go.mod"; then
  echo "build.sh: kube/go.mod does not require k8s.io/kubernetes $KUBE_VERSION (KUBE_VERSION in versions.env)" >&2
  exit 1
fi

mkdir -p "$bin"
rm -f "$bin"/.stamp-*
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
nice_go() { nice -n 10 go "$@"; }
start=$(date +%s)

# Version stamping the way the Kubernetes release build does it, so `--version` and the
# apiserver's /version report the pinned release (kwokctl reads them).
minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=2026-01-01T00:00:00Z"
done

echo "build.sh: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $KUBE_VERSION"
(cd "$here/kube" && nice_go build -trimpath -ldflags "$ldflags" -o "$bin/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)

echo "build.sh: etcd $ETCD_VERSION"
(cd "$here/etcd" && nice_go build -trimpath -ldflags "-s -w" -o "$bin/etcd" .)

# These three publish go.mod files without replace directives, so `go install mod@version`
# builds them with exactly their own pinned dependencies.
export GOBIN="$bin"
echo "build.sh: kwok, kwokctl $KWOK_VERSION"
nice_go install -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${KUBE_VERSION#v}" \
  "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "sigs.k8s.io/kwok/cmd/kwokctl@$KWOK_VERSION"
echo "build.sh: helm $HELM_VERSION"
nice_go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
  "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
echo "build.sh: kubeconform $KUBECONFORM_VERSION"
nice_go install -trimpath -ldflags "-s -w" "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"

all_present
touch "$stamp"
echo "build.sh: built in $(($(date +%s) - start)) s into $bin"
