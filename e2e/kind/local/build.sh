#!/usr/bin/env bash
# Builds, with no registry, what `kind create cluster` needs on this machine:
#
#   .cache/kind/bin/   kind, kubeadm and crictl from their Go modules (kubeadm from the local cluster's
#                      Kubernetes module and version stamp, e2e/cluster/kube)
#   the node image     $NODE_IMAGE:$KUBE_VERSION in the Docker engine that DOCKER_HOST names: kind's
#                      base-image recipe (its files, from kind's own module) on a Debian root filesystem
#                      made by debootstrap, with the local cluster's containerd, runc, CNI plugins,
#                      kubelet, kubeadm and kubectl, and preloaded with the images kubeadm runs (the
#                      control plane, etcd, CoreDNS, kube-proxy, pause), the pod network's (podnet) and
#                      the default StorageClass's (Rancher's local-path provisioner, storage.yaml), each
#                      built here from pinned modules
#
# The binaries come from e2e/cluster/build.sh (make tools). A second run with nothing changed is a
# no-op: the node image is labelled with a hash of everything that goes into it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
# shellcheck source=../../cluster/versions.env
source "$repo/e2e/cluster/versions.env"
# shellcheck source=versions.env
source "$here/versions.env"
state="$repo/.cache/kind"
bin="$state/bin"
cbin="$repo/e2e/cluster/bin"
log() { printf 'kind/build.sh: %s\n' "$*" >&2; }
# docker build, its output shown only when it fails (the classic builder prints a deprecation notice).
build() {
  local out
  out="$(docker build -q "$@" 2>&1)" || { printf '%s\n' "$out" >&2; return 1; }
}
die() { log "$*"; exit 1; }

docker info >/dev/null 2>&1 || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset}); e2e/kind/local/engine.sh start"
mkdir -p "$bin"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
# The classic builder: Debian's docker.io has no buildx.
export DOCKER_BUILDKIT=0

# 1. The local cluster's binaries (a no-op when built).
"$repo/e2e/cluster/build.sh"
for tool in kubelet kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl etcd containerd \
  containerd-shim-runc-v2 ctr runc coredns cni/bridge cni/host-local cni/loopback cni/portmap; do
  [[ -x "$cbin/$tool" ]] || die "e2e/cluster/bin/$tool is missing: e2e/cluster/build.sh did not build the real node ($(cat "$cbin/.node-unbuildable" 2>/dev/null || echo 'no reason recorded'))"
done

# LeaderWorkerSet's controller (a no-op when built), for multi-node replicas on kind.
"$repo/e2e/cluster/lws.sh" build >&2

# 2. kind, kubeadm, crictl.
if [[ "$("$bin/kind" version 2>/dev/null | awk '{print $2}')" != "$KIND_VERSION" ]]; then
  log "kind $KIND_VERSION"
  GOBIN="$bin" nice -n 10 go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION"
fi
if [[ "$("$bin/kubeadm" version -o short 2>/dev/null)" != "$KUBE_VERSION" ]]; then
  # kubeadm needs a few modules the local cluster's binaries do not (CoreDNS's Corefile migration,
  # the system validators): resolved into a copy of that go.mod, at the versions Kubernetes' own go.mod
  # names, so the tracked go.mod/go.sum stay as they are.
  log "kubeadm $KUBE_VERSION"
  mkdir -p "$state/kube"
  cp "$repo/e2e/cluster/kube/go.mod" "$repo/e2e/cluster/kube/go.sum" "$state/kube/"
  minor="${KUBE_VERSION#v1.}"
  minor="${minor%%.*}"
  ldflags="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=2026-01-01T00:00:00Z"
  done
  (cd "$repo/e2e/cluster/kube" && nice -n 10 go build -modfile="$state/kube/go.mod" -mod=mod -trimpath \
    -ldflags "$ldflags" -o "$bin/" k8s.io/kubernetes/cmd/kubeadm)
fi
if [[ "$("$bin/crictl" --version 2>/dev/null | awk '{print $3}')" != "$CRICTL_VERSION" ]]; then
  log "crictl $CRICTL_VERSION"
  GOBIN="$bin" nice -n 10 go install -trimpath -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" \
    "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
fi

# The default StorageClass's provisioner (storage.yaml), as kind's own node images ship it.
if [[ "$("$bin/local-path-provisioner" --version 2>/dev/null | awk '{print $3}')" != "$LOCAL_PATH_VERSION" ]]; then
  log "local-path-provisioner $LOCAL_PATH_VERSION"
  GOBIN="$bin" nice -n 10 go install -trimpath -ldflags "-s -w -X main.VERSION=$LOCAL_PATH_VERSION" \
    "github.com/rancher/local-path-provisioner@$LOCAL_PATH_VERSION"
fi

# kind's base-image files (entrypoint, systemd units, containerd config) from its module.
kind_src="$(go env GOMODCACHE)/sigs.k8s.io/kind@$KIND_VERSION"
[[ -d "$kind_src/images/base/files" ]] || (cd "$state" && go mod download "sigs.k8s.io/kind@$KIND_VERSION")
[[ -d "$kind_src/images/base/files" ]] || die "kind's base-image files are not in $kind_src"

# Our fake device plugin (fakegpu/main.go), preloaded for make e2e-kind's fake GPU workers.
(cd "$here/fakegpu" && nice -n 10 go build -trimpath -ldflags "-s -w" -o "$bin/fakegpu" .)

# What goes into the node image, hashed by content: a changed input gives a new image.
inputs_hash="$(
  cat "$repo/e2e/cluster/versions.env" "$here/versions.env" "$here/build.sh" "$here/podnet" "$here/podnet.yaml" \
    "$here/runc-wrapper" "$here/node.Dockerfile" "$here/storage.yaml" "$bin"/* \
    "$cbin"/{kubelet,kube-apiserver,kube-controller-manager,kube-scheduler,kube-proxy,kubectl,etcd} \
    "$cbin"/{containerd,containerd-shim-runc-v2,ctr,runc,coredns,pause} "$cbin"/cni/* "$cbin/lws/lws-controller" |
    sha1sum | cut -c1-16
)"
node_ref="$NODE_IMAGE:$KUBE_VERSION"
if [[ "$(docker image inspect -f '{{index .Config.Labels "sovereign.inputs"}}' "$node_ref" 2>/dev/null)" == "$inputs_hash" ]]; then
  log "$node_ref is up to date"
  exit 0
fi

# 3. The Debian root filesystem (debootstrap, kind's package list), imported once per list.
packages=(systemd systemd-sysv dbus conntrack iptables nftables iproute2 ethtool util-linux mount kmod
  libseccomp2 pigz bash ca-certificates curl jq procps fuse-overlayfs)
rootfs_ref="$ROOTFS_IMAGE:$(printf '%s\n' bookworm "${packages[@]}" | sha1sum | cut -c1-12)"
if ! docker image inspect "$rootfs_ref" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
  root="$state/rootfs"
  rm -rf "$root"
  log "debootstrap bookworm into $root (${#packages[@]} packages and their dependencies)"
  debootstrap --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" bookworm "$root" \
    "${mirror:-http://deb.debian.org/debian}" >"$state/debootstrap.log" 2>&1 ||
    die "debootstrap failed; see $state/debootstrap.log"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import - "$rootfs_ref" >/dev/null
  rm -rf "$root"
fi

# 4. The images kubeadm and the pod network run, as `docker save` archives (ctr imports them).
ctx="$state/context"
rm -rf "$ctx"
mkdir -p "$ctx/images" "$ctx/image"
mapfile -t wanted < <("$bin/kubeadm" config images list --kubernetes-version "$KUBE_VERSION")
sandbox="$(sed -n 's/^ *sandbox_image *= *"\(.*\)"/\1/p' "$kind_src/images/base/files/etc/containerd/config.toml")"
ref_of() {
  local r
  for r in "${wanted[@]}"; do [[ "$r" == */"$1":* || "$r" == */"$1"/*:* ]] && { echo "$r"; return; }; done
  die "kubeadm $KUBE_VERSION lists no image named $1"
}
# A static binary alone in an image (FROM scratch) at `dest`, its entrypoint, /usr/local/bin on PATH.
single() {
  local ref="$1" binary="$2" dest="$3"
  rm -rf "$ctx/image" && mkdir -p "$ctx/image"
  cp "$binary" "$ctx/image/payload"
  printf 'FROM scratch\nCOPY payload %s\nENV PATH=/usr/local/bin:/usr/bin:/bin\nENTRYPOINT ["%s"]\n' \
    "$dest" "$dest" >"$ctx/image/Dockerfile"
  build -t "$ref" "$ctx/image"
}
# Binaries on the Debian root filesystem (kube-proxy needs iptables; podnet bash, ip and kubectl).
on_rootfs() {
  local ref="$1" binary copies=""
  shift
  rm -rf "$ctx/image" && mkdir -p "$ctx/image"
  for binary in "$@"; do
    cp "$binary" "$ctx/image/"
    copies+="COPY $(basename "$binary") /usr/local/bin/$(basename "$binary")"$'\n'
  done
  printf 'FROM %s\n%s' "$rootfs_ref" "$copies" >"$ctx/image/Dockerfile"
  build -t "$ref" "$ctx/image"
}
log "images: kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, etcd, coredns, pause, podnet, fakegpu, lws, local-path"
for component in kube-apiserver kube-controller-manager kube-scheduler etcd; do
  single "$(ref_of "$component")" "$cbin/$component" "/usr/local/bin/$component"
done
# kubeadm's CoreDNS Deployment runs /coredns with its Corefile.
single "$(ref_of coredns)" "$cbin/coredns" /coredns
# containerd's sandbox image (kind's config) under kubeadm's pause reference too.
single "$sandbox" "$cbin/pause" /pause
docker tag "$sandbox" "$(ref_of pause)"
single "$FAKEGPU_IMAGE" "$bin/fakegpu" /fakegpu
# LeaderWorkerSet's manifests run /manager.
single "$LWS_IMAGE" "$cbin/lws/lws-controller" /manager
single "$LOCAL_PATH_IMAGE" "$bin/local-path-provisioner" /usr/local/bin/local-path-provisioner
# The provisioner's helper pods run /bin/sh scripts (mkdir, rm): the Debian root filesystem has them.
docker tag "$rootfs_ref" "$LOCAL_PATH_HELPER_IMAGE"
on_rootfs "$(ref_of kube-proxy)" "$cbin/kube-proxy"
on_rootfs "$PODNET_IMAGE" "$here/podnet" "$cbin/kubectl"
images=("${wanted[@]}" "$sandbox" "$PODNET_IMAGE" "$FAKEGPU_IMAGE" "$LWS_IMAGE" "$LOCAL_PATH_IMAGE" "$LOCAL_PATH_HELPER_IMAGE")
for i in "${!images[@]}"; do
  docker save -o "$ctx/images/$i.tar" "${images[$i]}"
done

# 5. The node image: kind's base recipe, the binaries, then the images imported into its containerd.
mkdir -p "$ctx/files" "$ctx/bin" "$ctx/cni" "$ctx/manifests"
cp -r "$kind_src/images/base/files/." "$ctx/files/"
chmod -R u+w "$ctx/files"
cp "$cbin"/{containerd,containerd-shim-runc-v2,ctr,runc} "$bin/crictl" "$here/runc-wrapper" "$ctx/bin/"
cp "$cbin"/cni/* "$ctx/cni/"
cp "$cbin/kubelet" "$cbin/kubectl" "$bin/kubeadm" "$ctx/bin/"
sed "s|image: IMAGE|image: $PODNET_IMAGE|" "$here/podnet.yaml" >"$ctx/manifests/default-cni.yaml"
sed -e "s|PROVISIONER_IMAGE|$LOCAL_PATH_IMAGE|" -e "s|HELPER_IMAGE|$LOCAL_PATH_HELPER_IMAGE|" "$here/storage.yaml" \
  >"$ctx/manifests/default-storage.yaml"
printf '%s\n' "$KUBE_VERSION" >"$ctx/version"
cp "$here/node.Dockerfile" "$ctx/Dockerfile"
log "node image stage from $rootfs_ref"
stage="$NODE_IMAGE:stage-$inputs_hash"
build --build-arg "ROOTFS=$rootfs_ref" -t "$stage" "$ctx"

builder="sovereign-kind-build-$$"
trap 'docker rm -f "$builder" >/dev/null 2>&1 || true' EXIT
docker run -d --name "$builder" --privileged --entrypoint sleep -v "$ctx/images:/kind/images:ro" "$stage" infinity >/dev/null
docker exec "$builder" bash -c 'nohup containerd >/var/log/containerd-build.log 2>&1 &
  for _ in $(seq 50); do [[ -S /run/containerd/containerd.sock ]] && ctr version >/dev/null 2>&1 && exit 0; sleep 0.2; done
  cat /var/log/containerd-build.log; exit 1'
for i in "${!images[@]}"; do
  out="$(docker exec "$builder" ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned \
    --no-unpack --digests "/kind/images/$i.tar" 2>&1)" || die "importing ${images[$i]} into the node image: $out"
done
docker exec "$builder" bash -c 'pkill containerd; for _ in $(seq 50); do pgrep -x containerd >/dev/null || break; sleep 0.2; done; rm -f /var/log/containerd-build.log'
docker commit \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' \
  --change 'CMD []' \
  --change "LABEL sovereign.inputs=$inputs_hash" \
  "$builder" "$node_ref" >/dev/null
docker rm -f "$builder" >/dev/null
docker image rm "$stage" >/dev/null || log "could not remove the build stage image $stage"
rm -rf "$ctx"
log "built $node_ref ($(docker image inspect -f '{{.Size}}' "$node_ref" | awk '{printf "%.0f MB", $1 / 1e6}'))"
