#!/usr/bin/env bash
# Builds the local cluster's binaries into e2e/cluster/bin/ from pinned upstream Go modules.
#
#   control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok,
#                  kwokctl, helm, kubeconform
#   real node:     kubelet, kube-proxy, containerd, containerd-shim-runc-v2, ctr, runc, the CNI
#                  plugins (bin/cni/), CoreDNS, a pause binary, and the one-layer images of pause,
#                  CoreDNS and the tests' server (bin/images/*.tar, written by e2e/images/oci.py)
#
# Nothing is downloaded except Go modules through the module proxy and, as root, the Debian packages
# the node's cgo builds need (runc links libseccomp; pause is static C). Each group has a stamp (a hash
# of versions.env, its go.mod/go.sum files, its sources and this script), so a second run is a no-op
# and a changed pin rebuilds that group. Go builds run one at a time and niced: CI machines are small
# and shared. Where the node's build prerequisites are missing and cannot be installed (not root), the
# node group is skipped with one line and bin/.node-unbuildable says why; the control plane still builds.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin="$here/bin"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$here/versions.env"
# shellcheck source-path=SCRIPTDIR source=node/packages.sh
source "$here/node/packages.sh"

hash_of() { cat "$@" | sha1sum | cut -c1-16; }
control_stamp="$bin/.stamp-control-$(hash_of "$here/versions.env" "$here"/kube/go.mod "$here"/kube/go.sum \
  "$here"/etcd/go.mod "$here"/etcd/go.sum "$here/build.sh")"
node_stamp="$bin/.stamp-node-$(hash_of "$here/versions.env" "$here"/kube/go.mod "$here"/kube/go.sum \
  "$here"/coredns/go.mod "$here"/coredns/go.sum "$here"/coredns/main.go "$here"/node/pause.c \
  "$here"/node/testserver/go.mod "$here"/node/testserver/main.go "$repo/e2e/images/oci.py" "$here/build.sh")"
control_tools=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kwokctl helm kubeconform)
node_tools=(kubelet kube-proxy containerd containerd-shim-runc-v2 ctr runc coredns pause
  cni/bridge cni/host-local cni/loopback cni/portmap)
node_images=(pause coredns testserver)

all_present() {
  local t
  for t in "$@"; do [[ -x "$bin/$t" ]] || return 1; done
}
images_present() {
  local i
  for i in "${node_images[@]}"; do [[ -s "$bin/images/$i.tar" ]] || return 1; done
}

control_built() { [[ -f "$control_stamp" ]] && all_present "${control_tools[@]}"; }
node_built() { [[ -f "$node_stamp" ]] && all_present "${node_tools[@]}" && images_present; }

if control_built && node_built; then
  exit 0
fi

command -v go >/dev/null || { echo "build.sh: 'go' is required to build the local cluster" >&2; exit 1; }

# The kube module's go.mod must require the version that versions.env names (it is stamped below).
if ! grep -Eq "^\s*k8s.io/kubernetes $KUBE_VERSION( |$)" "$here/kube/go.mod"; then
  echo "build.sh: kube/go.mod does not require k8s.io/kubernetes $KUBE_VERSION (KUBE_VERSION in versions.env)" >&2
  exit 1
fi
if ! grep -Eq "^require github.com/coredns/coredns $COREDNS_VERSION$" "$here/coredns/go.mod"; then
  echo "build.sh: coredns/go.mod does not require github.com/coredns/coredns $COREDNS_VERSION (COREDNS_VERSION in versions.env)" >&2
  exit 1
fi

mkdir -p "$bin"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
nice_go() { nice -n 10 go "$@"; }
start=$(date +%s)

# Version stamping the way the Kubernetes release build does it, so `--version`, the apiserver's
# /version and the kubelet's node status report the pinned release (kwokctl reads them).
minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
kube_ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  kube_ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=2026-01-01T00:00:00Z"
done

build_control_plane() {
  rm -f "$bin"/.stamp-control-* "$bin"/.stamp-[0-9a-f]*
  echo "build.sh: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $KUBE_VERSION"
  (cd "$here/kube" && nice_go build -trimpath -ldflags "$kube_ldflags" -o "$bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)

  echo "build.sh: etcd $ETCD_VERSION"
  (cd "$here/etcd" && nice_go build -trimpath -ldflags "-s -w" -o "$bin/etcd" .)

  # These three publish go.mod files without replace directives, so `go install mod@version`
  # builds them with exactly their own pinned dependencies.
  echo "build.sh: kwok, kwokctl $KWOK_VERSION"
  GOBIN="$bin" nice_go install -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${KUBE_VERSION#v}" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "sigs.k8s.io/kwok/cmd/kwokctl@$KWOK_VERSION"
  echo "build.sh: helm $HELM_VERSION"
  GOBIN="$bin" nice_go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  echo "build.sh: kubeconform $KUBECONFORM_VERSION"
  GOBIN="$bin" nice_go install -trimpath -ldflags "-s -w" "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"

  all_present "${control_tools[@]}"
  touch "$control_stamp"
}

build_node() {
  rm -f "$bin"/.stamp-node-* "$bin/.node-unbuildable"
  echo "build.sh: kubelet, kube-proxy $KUBE_VERSION"
  (cd "$here/kube" && nice_go build -trimpath -ldflags "$kube_ldflags" -o "$bin/" \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy)

  # containerd's go.mod has no replace directives. Pure Go (as its static release): the btrfs,
  # devmapper and zfs snapshotters need cgo and are not used (overlayfs is); the shim is built without
  # gRPC, as containerd's Makefile does.
  local ctrd=github.com/containerd/containerd/v2
  local ctrd_ldflags="-s -w -X $ctrd/version.Version=$CONTAINERD_VERSION -X $ctrd/version.Package=$ctrd"
  local ctrd_tags="urfave_cli_no_docs no_btrfs no_devmapper no_zfs osusergo netgo"
  echo "build.sh: containerd, ctr, containerd-shim-runc-v2 $CONTAINERD_VERSION"
  GOBIN="$bin" nice_go install -trimpath -tags "$ctrd_tags" -ldflags "$ctrd_ldflags" \
    "$ctrd/cmd/containerd@$CONTAINERD_VERSION" "$ctrd/cmd/ctr@$CONTAINERD_VERSION"
  GOBIN="$bin" nice_go install -trimpath -tags "$ctrd_tags no_grpc" -ldflags "$ctrd_ldflags" \
    "$ctrd/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION"

  # runc needs cgo (its nsexec is C) and libseccomp for seccomp profiles (RuntimeDefault); linked
  # statically, it depends on nothing at run time. Without the libpathrs tag (a Rust library) it uses
  # its Go path resolution.
  echo "build.sh: runc $RUNC_VERSION"
  CGO_ENABLED=1 GOBIN="$bin" nice_go install -trimpath -tags "seccomp urfave_cli_no_docs netgo osusergo" \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v} -extldflags -static" \
    "github.com/opencontainers/runc@$RUNC_VERSION"

  local cni=github.com/containernetworking/plugins
  echo "build.sh: CNI plugins bridge, host-local, loopback, portmap $CNI_PLUGINS_VERSION"
  mkdir -p "$bin/cni"
  GOBIN="$bin/cni" nice_go install -trimpath \
    -ldflags "-s -w -X $cni/pkg/utils/buildversion.BuildVersion=$CNI_PLUGINS_VERSION" \
    "$cni/plugins/main/bridge@$CNI_PLUGINS_VERSION" "$cni/plugins/ipam/host-local@$CNI_PLUGINS_VERSION" \
    "$cni/plugins/main/loopback@$CNI_PLUGINS_VERSION" "$cni/plugins/meta/portmap@$CNI_PLUGINS_VERSION"

  echo "build.sh: coredns $COREDNS_VERSION (cluster-DNS plugins only, coredns/main.go)"
  (cd "$here/coredns" && nice_go build -trimpath -ldflags "-s -w" -o "$bin/coredns" .)

  echo "build.sh: pause, testserver, images"
  mkdir -p "$bin/images"
  nice -n 10 gcc -Os -static -Wall -Wextra -Werror -o "$bin/pause" "$here/node/pause.c"
  strip "$bin/pause"
  (cd "$here/node/testserver" && nice_go build -trimpath -ldflags "-s -w" -o "$bin/images/testserver" .)
  local oci=(python3 "$repo/e2e/images/oci.py")
  "${oci[@]}" --ref "$PAUSE_IMAGE" --file "$bin/pause=/pause" --entrypoint /pause --out "$bin/images/pause.tar" >/dev/null
  "${oci[@]}" --ref "$COREDNS_IMAGE" --file "$bin/coredns=/coredns" --entrypoint /coredns \
    --out "$bin/images/coredns.tar" >/dev/null
  "${oci[@]}" --ref "$TESTSERVER_IMAGE" --file "$bin/images/testserver=/testserver" --entrypoint /testserver \
    --out "$bin/images/testserver.tar" >/dev/null
  rm -f "$bin/images/testserver"

  all_present "${node_tools[@]}" && images_present
  touch "$node_stamp"
}

control_built || build_control_plane
if ! node_built; then
  # runc links libseccomp statically; pause is static C.
  if reason=$(ensure_debian_packages "the real node's build" gcc libc6-dev libseccomp-dev pkg-config); then
    build_node
  else
    echo "$reason" >"$bin/.node-unbuildable"
    echo "build.sh: the real node is not built: $reason" >&2
  fi
fi
echo "build.sh: built in $(($(date +%s) - start)) s into $bin"
