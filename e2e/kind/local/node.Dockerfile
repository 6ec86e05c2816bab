# The local kind node image's first stage (e2e/kind/local/build.sh): kind's base-image recipe
# (images/base/Dockerfile of the pinned kind module) on a Debian root filesystem made by debootstrap,
# with binaries built here instead of downloaded. build.sh then imports the images into containerd and
# commits the result with kind's entrypoint.
ARG ROOTFS
FROM ${ROOTFS}
COPY files/ /
COPY bin/containerd bin/containerd-shim-runc-v2 bin/ctr bin/crictl /usr/local/bin/
COPY bin/runc bin/runc-wrapper /usr/local/sbin/
COPY cni/ /opt/cni/bin/
COPY bin/kubelet bin/kubeadm bin/kubectl /usr/bin/
COPY manifests/ /kind/manifests/
COPY version /kind/version
# As kind's base image: systemd trimmed to what a node needs, containerd and the kubelet enabled.
RUN chmod 755 /kind /kind/bin /kind/bin/* /usr/local/bin/* /usr/local/sbin/* /opt/cni/bin/* \
    && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \
    && rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
      /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
      /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/* \
    && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \
    && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
    && systemctl mask systemd-binfmt.service \
    && mkdir -p /etc/kubernetes/manifests \
    && ctr oci spec \
      | jq '.hooks.createContainer[.hooks.createContainer | length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
      | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json
# Where root is refused CAP_SYS_RESOURCE (some VMs withhold it from every process): containerd's runc
# goes through runc-wrapper, which drops from a privileged container's spec what cannot be granted;
# container OOM scores stay at or above containerd's own (a lower one needs that capability), and
# systemd does not try to lower containerd's; the kubelet is allowed to start on cgroup v1 hosts.
RUN sed -i 's|^\( *\)SystemdCgroup = true|&\n\1BinaryName = "/usr/local/sbin/runc-wrapper"|' /etc/containerd/config.toml \
    && sed -i 's|^\( *restrict_oom_score_adj\) = false|\1 = true|' /etc/containerd/config.toml \
    && grep -c 'BinaryName = "/usr/local/sbin/runc-wrapper"' /etc/containerd/config.toml | grep -qx 2 \
    && grep -q 'restrict_oom_score_adj = true' /etc/containerd/config.toml \
    && mkdir -p /etc/systemd/system/containerd.service.d \
    && printf '[Service]\nOOMScoreAdjust=0\n' > /etc/systemd/system/containerd.service.d/10-oom-score.conf \
    && sed -i 's|^KUBELET_EXTRA_ARGS=.*|& --fail-cgroupv1=false|' /etc/default/kubelet \
    && grep -q -- '--fail-cgroupv1=false' /etc/default/kubelet
# kind's node entrypoint (images/base/Dockerfile's last stage).
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
