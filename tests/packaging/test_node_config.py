"""e2e/cluster/node/node.py without a machine: the real node's names, addresses, configuration files
and the parsers its bring-up and teardown rely on."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def node() -> ModuleType:
    return load("node", REPO / "e2e" / "cluster" / "node" / "node.py")


@pytest.fixture
def layout(node: ModuleType, tmp_path: Path):  # type: ignore[no-untyped-def]
    return node.Layout(name="sovereign", state=tmp_path / ".cluster", bin=REPO / "e2e/cluster/bin", slot=7)


def test_ids_are_stable_per_state_dir_and_name_and_differ_across_them(
    node: ModuleType, tmp_path: Path
) -> None:
    a = node.node_id(tmp_path / "a", "sovereign")
    assert a == node.node_id(tmp_path / "a", "sovereign")
    assert len({a, node.node_id(tmp_path / "b", "sovereign"), node.node_id(tmp_path / "a", "other")}) == 3
    assert len(a) == 8 and int(a, 16) >= 0


def test_a_slot_gives_a_link_pair_and_a_pod_subnet(node: ModuleType, layout) -> None:  # type: ignore[no-untyped-def]
    assert (layout.host_ip, layout.node_ip) == ("10.243.7.1", "10.243.7.2")
    assert layout.link == ipaddress.IPv4Network("10.243.7.0/30")
    assert layout.pod_cidr == ipaddress.IPv4Network("10.244.7.0/24")
    assert len(layout.host_veth) <= 15  # IFNAMSIZ - 1
    assert layout.netns == f"sovereign-{layout.id}" and layout.cgroup_root == f"/sovereign-{layout.id}"
    assert len(str(layout.containerd_socket)) < 60  # under /run/sovereign, whatever the state dir


def route(dst: str, dev: str = "eth0") -> dict[str, str]:
    return {"dst": dst, "dev": dev}


def test_slots_skip_routed_networks_and_other_nodes_claims(node: ModuleType) -> None:
    routes = [
        route("default"),
        route("192.0.2.0/24"),
        route("10.244.0.0/24", "sovother"),
        route("10.243.1.1"),
    ]
    # 0: its pod subnet is another node's route; 1: a host route inside its link; 2: claimed.
    assert node.choose_slot(routes, {2: "otherid1"}, "mine0000", "svmine", None) == 3
    # The slot a node had is kept while free, and a route through its own veth does not count.
    assert node.choose_slot([*routes, route("10.244.9.0/24", "svmine")], {}, "mine0000", "svmine", 9) == 9
    assert node.choose_slot(routes, {9: "mine0000"}, "mine0000", "svmine", 9) == 9
    # A preferred slot that is taken now gives way to the lowest free one.
    assert node.choose_slot(routes, {9: "otherid1"}, "mine0000", "svmine", 9) == 2


def test_no_slot_when_the_whole_range_is_routed(node: ModuleType) -> None:
    with pytest.raises(node.NodeError, match="no free address slot"):
        node.choose_slot([route("10.244.0.0/16")], {}, "mine0000", "svmine", None)


def run_dir(  # type: ignore[no-untyped-def]
    node: ModuleType, id_: str, owner: Path | None, records: bool, alive: bool, age: float = 3600
):
    return node.RunDir(
        id=id_,
        owner_state=owner,
        owner_name=None if owner is None else "sovereign",
        owner_records_it=records,
        daemons_alive=alive,
        age_s=age,
    )


def test_orphans_are_nodes_whose_cluster_state_is_gone_and_nothing_else(node: ModuleType) -> None:
    gone, here = Path("/tmp/deleted-clone/.cluster"), Path("/work/live/.cluster")
    found = node.orphans(
        [
            run_dir(node, "aaaaaaaa", gone, records=False, alive=True),  # clone deleted, cluster running
            run_dir(node, "bbbbbbbb", gone, records=False, alive=False),  # deleted after the processes died
            run_dir(node, "cccccccc", here, records=True, alive=False),  # stopped: its owner may restart it
            run_dir(node, "dddddddd", here, records=True, alive=True),
            run_dir(node, "eeeeeeee", None, records=False, alive=False),  # from before owner records, dead
            run_dir(node, "ffffffff", None, records=False, alive=True),  # from before owner records, running
            run_dir(node, "22222222", None, records=False, alive=False, age=5),  # being set up right now
            run_dir(node, "11111111", gone, records=False, alive=True),  # the node being brought up
        ],
        own_id="11111111",
    )
    why_gone = f"its cluster's state dir {gone} no longer records it"
    assert [(d.id, why) for d, why in found] == [
        ("aaaaaaaa", why_gone),
        ("bbbbbbbb", why_gone),
        ("eeeeeeee", "it records no owner and none of its daemons runs"),
    ]


def test_an_orphans_control_plane_is_found_by_the_paths_on_its_command_lines(node: ModuleType) -> None:
    state = Path("/tmp/x/fresh/.cluster")
    cmdlines = [
        (10, "/tmp/x/fresh/e2e/cluster/bin/etcd --data-dir /tmp/x/fresh/.cluster/kwok/clusters/s/etcd"),
        (11, "kube-apiserver --client-ca-file=/tmp/x/fresh/.cluster/kwok/clusters/s/pki/ca.crt"),
        (12, "kube-apiserver --client-ca-file=/tmp/x/fresh/.cluster2/kwok/clusters/s/pki/ca.crt"),
        (13, "etcd --data-dir /tmp/x/fresh/.clusterish"),
        (14, "bash"),
    ]
    assert node.processes_naming(cmdlines, state) == [10, 11]
    assert node.processes_naming(cmdlines, Path("/tmp/x/fresh/.cluster/")) == [10, 11]


def test_the_owner_record_names_the_state_dir_and_the_cluster(node: ModuleType, tmp_path: Path) -> None:
    assert json.loads(node.owner_record(tmp_path / "a" / ".." / ".cluster", "eng3")) == {
        "state": str((tmp_path / ".cluster").resolve()),
        "name": "eng3",
    }
    # An orphan's layout is addressed by the id found on the machine, whatever its state dir.
    orphan = node.Layout(name="x", state=tmp_path, bin=tmp_path, slot=0, known_id="0123abcd")
    assert orphan.netns == "sovereign-0123abcd" and orphan.run == node.RUN_ROOT / "0123abcd"


def test_containerd_keeps_everything_per_node_and_pins_the_local_pause_image(
    node: ModuleType, layout
) -> None:  # type: ignore[no-untyped-def]
    text = node.containerd_config(layout, "sovereign.local/node/pause:1", restrict_oom_score_adj=True)
    config = tomllib.loads(text)
    plugins = config["plugins"]
    assert config["version"] == 4 and config["imports"] == []
    assert config["root"] == "/var/lib/containerd"  # the node's own /var/lib (its mount namespace)
    assert plugins["io.containerd.server.v1.grpc"]["address"] == str(layout.containerd_socket)
    assert plugins["io.containerd.shim.v1.manager"]["socket_dir"].startswith(str(layout.run))
    assert (
        plugins["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == "sovereign.local/node/pause:1"
    )
    runtime = plugins["io.containerd.cri.v1.runtime"]
    assert runtime["restrict_oom_score_adj"] is True and runtime["netns_mounts_under_state_dir"] is True
    runc = runtime["containerd"]["runtimes"]["runc"]["options"]
    assert runc["SystemdCgroup"] is False and runc["Root"].startswith(str(layout.run))
    assert runtime["cni"]["conf_dir"] == str(layout.etc / "cni")
    assert "io.containerd.nri.v1.nri" in config["disabled_plugins"]  # its socket is machine-wide
    # No machine-wide path of a default containerd install.
    for shared in ("/run/containerd", "/etc/containerd", "/opt/cni", "/etc/cni", "/var/run/nri"):
        assert f'"{shared}' not in text
    unrestricted = tomllib.loads(node.containerd_config(layout, "p:1", restrict_oom_score_adj=False))
    assert unrestricted["plugins"]["io.containerd.cri.v1.runtime"]["restrict_oom_score_adj"] is False


def test_configuration_files_are_rewritten_only_when_they_change(node: ModuleType, layout) -> None:  # type: ignore[no-untyped-def]
    """kube-proxy exits when its configuration file is written, so an unchanged file is left alone
    and only the daemons whose files changed are restarted."""
    (layout.etc / "cni").mkdir(parents=True)
    versions = node.parse_env_file((REPO / "e2e" / "cluster" / "versions.env").read_text())
    n = node.Node(layout=layout, kubectl_kubeconfig=layout.state / "kubeconfig", versions=versions)
    assert n.write_configs(6443) == {"containerd", "kubelet", "kube-proxy", "apiserver-forward"}
    written = {p: p.stat().st_mtime_ns for p in layout.etc.rglob("*") if p.is_file()}
    assert n.write_configs(6443) == set()
    assert {p: p.stat().st_mtime_ns for p in written} == written
    # The apiserver's port is in both kubeconfigs and is where the forwarder listens.
    assert n.write_configs(7443) == {"kubelet", "kube-proxy", "apiserver-forward"}


def test_pods_get_the_nodes_subnet_on_a_bridge_without_nat(node: ModuleType, layout) -> None:  # type: ignore[no-untyped-def]
    config = node.cni_config(layout)
    bridge, portmap = config["plugins"]
    assert config["name"] == layout.network_name
    assert bridge["type"] == "bridge" and bridge["isGateway"] and not bridge["ipMasq"]
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.244.7.0/24", "gateway": "10.244.7.1"}]]
    assert portmap == {"type": "portmap", "capabilities": {"portMappings": True}}


def test_kubelet_configuration(node: ModuleType, layout) -> None:  # type: ignore[no-untyped-def]
    config = node.kubelet_config(layout)
    assert config["failCgroupV1"] is False and config["cgroupDriver"] == "cgroupfs"
    assert config["cgroupRoot"] == layout.cgroup_root
    assert config["containerRuntimeEndpoint"] == f"unix://{layout.containerd_socket}"
    assert config["clusterDNS"] == [node.DNS_SERVICE_IP] and config["clusterDomain"] == "cluster.local"
    assert config["authentication"]["anonymous"] == {"enabled": False}
    assert config["authorization"]["mode"] == "Webhook"
    assert config["address"] == layout.node_ip and config["readOnlyPort"] == 0
    # Image GC off, so the big runtime image is never evicted while the disk is fine.
    assert config["imageGCHighThresholdPercent"] == 100
    assert set(config["evictionHard"]) >= {"memory.available", "nodefs.available", "imagefs.available"}


def test_kube_proxy_configuration(node: ModuleType, layout) -> None:  # type: ignore[no-untyped-def]
    config = node.kube_proxy_config(layout)
    assert config["mode"] == "iptables" and config["clusterCIDR"] == "10.244.7.0/24"
    assert config["hostnameOverride"] == node.NODE_NAME
    assert config["conntrack"]["maxPerCore"] == 0  # the machine-wide table is left alone


def test_coredns_serves_the_cluster_domain_only_on_the_real_node(node: ModuleType) -> None:
    objects = {o["kind"]: o for o in node.coredns_manifests("sovereign.local/node/coredns:v1")}
    service, deployment = objects["Service"], objects["Deployment"]
    assert service["spec"]["clusterIP"] == node.DNS_SERVICE_IP
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "sovereign.local/node/coredns:v1"
    assert pod["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    assert pod["nodeSelector"] == {"sovereign.ai/real-node": "true"}
    corefile = objects["ConfigMap"]["data"]["Corefile"]
    assert "kubernetes cluster.local" in corefile
    assert "forward" not in corefile  # no upstream: nothing leaves the machine


def test_mounts_below_are_listed_deepest_first(node: ModuleType) -> None:
    mountinfo = "\n".join(
        [
            "22 1 8:1 / / rw - ext4 /dev/vda rw",
            r"90 22 0:50 / /s/node-a/var\040lib/x rw - tmpfs tmpfs rw",
            "91 22 0:51 / /s/node-a rw - tmpfs tmpfs rw",
            "92 91 0:52 / /s/node-a/k/pods/v rw - tmpfs tmpfs rw",
            "93 22 0:53 / /s/node-ab/k rw - tmpfs tmpfs rw",
            "94 22 0:54 / /run/sovereign/abc/mnt rw - nsfs nsfs rw",
        ]
    )
    found = node.mounts_below(mountinfo, [Path("/s/node-a"), Path("/run/sovereign/abc")])
    assert found == ["/s/node-a/k/pods/v", "/s/node-a/var lib/x", "/run/sovereign/abc/mnt", "/s/node-a"]


def test_cgroup_hierarchies_of_a_hybrid_machine(node: ModuleType) -> None:
    mountinfo = "\n".join(
        [
            "30 25 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory",
            "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct",
            "32 25 0:28 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd,xattr",
            "33 25 0:29 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate",
            "34 22 0:30 / /proc rw - proc proc rw",
        ]
    )
    assert node.cgroup_hierarchies(mountinfo) == {
        Path("/sys/fs/cgroup/memory"): {"memory"},
        Path("/sys/fs/cgroup/cpu,cpuacct"): {"cpu", "cpuacct"},
        Path("/sys/fs/cgroup/systemd"): {"name=systemd", "xattr"},
        Path("/sys/fs/cgroup/unified"): {"cgroup2"},
    }


def test_image_archives_are_read_and_compared_by_manifest_digest(node: ModuleType, tmp_path: Path) -> None:
    oci = load("oci", REPO / "e2e" / "images" / "oci.py")
    payload = tmp_path / "hello"
    payload.write_text("hi\n")
    out = tmp_path / "hello.tar"
    assert (
        oci.main(["--ref", "sovereign.local/test/hello:1", "--file", f"{payload}=/hello", "--out", str(out)])
        == 0
    )
    ref, digest = node.archive_image(out)
    assert ref == "sovereign.local/test/hello:1" and digest.startswith("sha256:")
    listing = (
        "REF TYPE DIGEST SIZE PLATFORMS LABELS\n"
        f"{ref} application/vnd.oci.image.manifest.v1+json {digest} 1.2 KiB linux/amd64 -\n"
        "sovereign.local/node/pause:1 application/vnd.oci.image.manifest.v1+json sha256:ab 700 KiB linux/amd64 -\n"
    )
    assert node.image_digests(listing)[ref] == digest
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"not a tar")
    with pytest.raises(node.NodeError, match="not an OCI image archive"):
        node.archive_image(broken)


def test_versions_env_is_read_like_the_shell_reads_it(node: ModuleType) -> None:
    versions = node.parse_env_file((REPO / "e2e" / "cluster" / "versions.env").read_text())
    assert versions["PAUSE_IMAGE"] and versions["COREDNS_IMAGE"].endswith(versions["COREDNS_VERSION"])
    assert node.parse_env_file("# c\nA=1\nB='x y'\n\n") == {"A": "1", "B": "x y"}


def test_a_machine_without_the_node_binaries_says_so_and_real_node_exits_3(
    node: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    assert "not built" in node.unsupported_reason(empty)
    (empty / ".node-unbuildable").write_text(
        "the real node's build needs the Debian packages libseccomp-dev\n"
    )
    assert "libseccomp-dev" in node.unsupported_reason(empty)
    args = ["--name", "x", "--state", str(tmp_path / "state"), "--bin", str(empty)]
    assert node.main([*args, "real-node"]) == 3
    assert "libseccomp-dev" in capsys.readouterr().err
    assert node.main([*args, "plan"]) == 3
    assert "libseccomp-dev" in (tmp_path / "state" / "node-x.unavailable").read_text()


def test_the_fake_node_namespace_annotations_match_the_fake_nodes() -> None:
    """The namespaces of fake-pod tests select kwok's nodes and tolerate exactly their taints."""
    annotations = json.loads((REPO / "e2e/cluster/kwok/fake-namespace-annotations.json").read_text())
    assert annotations["scheduler.alpha.kubernetes.io/node-selector"] == "type=kwok"
    tolerations = json.loads(annotations["scheduler.alpha.kubernetes.io/defaultTolerations"])
    assert {t["key"] for t in tolerations} == {"kwok.x-k8s.io/node", "nvidia.com/gpu"}
    nodes = (REPO / "e2e/cluster/kwok/nodes.yaml").read_text()
    assert nodes.count("type: kwok") == 5 and nodes.count("key: nvidia.com/gpu") == 4
