"""The pieces of `make e2e-kind` (e2e/kind/local/) that run without a Docker engine: the runc wrapper
that lets privileged containers start where the machine withholds a capability, the scripts'
argument handling, and the manifests the node image and run.sh apply (valid for the pinned
Kubernetes). The whole path (engine, node image, kind cluster, up.sh and its suite) is `make e2e-kind`,
measured in docs/BENCHMARKS.md; it is not part of `make test`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging_helpers import REPO, SCHEMA_LOCATION, kube_version, load_docs, write_builtin_schemas

LOCAL = REPO / "e2e" / "kind" / "local"
ALL_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
    "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
    "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
]  # fmt: skip


def bounding_set() -> set[str]:
    """The capabilities this process's bounding set holds (what the wrapper may keep)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("CapBnd:"))
    bits = int(line.split()[1], 16)
    return {name for i, name in enumerate(ALL_CAPS) if bits >> i & 1}


def fake_runc(tmp_path: Path) -> Path:
    """A 'real runc' that records its arguments."""
    runc = tmp_path / "runc"
    runc.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/args\n')
    runc.chmod(0o755)
    return runc


def wrapper(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("jq") is None:
        pytest.fail("jq is missing: runc-wrapper edits the OCI spec with it (engine.sh installs it)")
    return subprocess.run(
        ["bash", str(LOCAL / "runc-wrapper"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "SOVEREIGN_REAL_RUNC": str(fake_runc(tmp_path))},
    )


def caps_spec() -> dict[str, list[str]]:
    return {kind: list(ALL_CAPS) for kind in ("bounding", "effective", "permitted", "inheritable")}


@pytest.mark.parametrize("bundle_flag", ["--bundle", "-b", "--bundle="])
def test_create_keeps_only_the_capabilities_the_machine_can_grant(tmp_path: Path, bundle_flag: str) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = {"ociVersion": "1.2.0", "process": {"args": ["/sbin/init"], "capabilities": caps_spec()}}
    (bundle / "config.json").write_text(json.dumps(config))
    flag = [f"--bundle={bundle}"] if bundle_flag.endswith("=") else [bundle_flag, str(bundle)]
    args = ["--root", "/run/runc", "--log-format", "json", "create", *flag, "--pid-file", "p", "ctr-1"]
    proc = wrapper(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    after = json.loads((bundle / "config.json").read_text())
    keep = [c for c in ALL_CAPS if c in bounding_set()]
    for kind in ("bounding", "effective", "permitted", "inheritable"):
        assert after["process"]["capabilities"][kind] == keep
    assert after["process"]["args"] == ["/sbin/init"]  # nothing else touched
    assert (tmp_path / "args").read_text().splitlines() == args  # the real runc gets the same arguments


def test_exec_strips_the_process_file_and_other_commands_pass_through(tmp_path: Path) -> None:
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["sh"], "capabilities": caps_spec()}))
    proc = wrapper(tmp_path, "exec", "--process", str(process), "ctr-1")
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(process.read_text())["capabilities"]["effective"]) <= bounding_set()
    # state/delete/kill: no spec to edit, arguments untouched.
    proc = wrapper(tmp_path, "--root", "/run/runc", "delete", "--force", "ctr-1")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "args").read_text().splitlines() == [
        "--root",
        "/run/runc",
        "delete",
        "--force",
        "ctr-1",
    ]


def test_a_spec_without_capabilities_is_left_as_it_is(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    text = json.dumps({"ociVersion": "1.2.0", "process": {"args": ["true"]}})
    (bundle / "config.json").write_text(text)
    assert wrapper(tmp_path, "run", "--bundle", str(bundle), "c").returncode == 0
    assert json.loads((bundle / "config.json").read_text()) == json.loads(text)


@pytest.mark.parametrize("script", ["run.sh", "engine.sh"])
def test_the_scripts_reject_what_they_do_not_know(script: str) -> None:
    proc = subprocess.run(
        ["bash", str(LOCAL / script), "--frobnicate"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr


def test_the_suite_up_sh_test_runs_is_collected_as_up_sh_names_it() -> None:
    """`up.sh test` hands pytest tests/cluster and tests/packaging/test_chart_install.py together:
    both directories' conftest modules are then loaded, and a test importing `conftest` by name got
    the other one (found running `make e2e-kind`). Collecting exactly that selection must work."""
    up = (REPO / "e2e" / "kind" / "up.sh").read_text()
    args = up.split(".venv/bin/pytest ", 1)[1].splitlines()[0].split()
    assert args[:2] == ["-m", "cluster"], args
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error" not in proc.stdout.splitlines()[-1].lower(), proc.stdout[-2000:]


def _lws_manifests() -> object:
    """e2e/kind/local/lws_manifests.py, loaded by path (a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lws_manifests", LOCAL / "lws_manifests.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lws_manifests_run_our_image_small_and_non_root_and_leave_the_rest_as_upstream_wrote_it() -> None:
    lws = _lws_manifests()
    upstream = [
        {"kind": "Namespace", "metadata": {"name": "lws-system"}},
        None,  # an empty document between two `---`
        {
            "kind": "Deployment",
            "metadata": {"name": "lws-controller-manager", "namespace": "lws-system"},
            "spec": {
                "replicas": 2,
                "template": {
                    "spec": {
                        "securityContext": {"runAsNonRoot": True},
                        "containers": [
                            {
                                "name": "manager",
                                "image": "registry.example/lws:release",
                                "resources": {"requests": {"cpu": 1, "memory": "1Gi"}},
                            }
                        ],
                    }
                },
            },
        },
    ]
    fitted = lws.fit_for_kind(upstream, "sovereign.local/kind/lws:local")  # type: ignore[attr-defined]
    assert [d["kind"] for d in fitted] == ["Namespace", "Deployment"]
    assert fitted[0] == {"kind": "Namespace", "metadata": {"name": "lws-system"}}
    deployment = fitted[1]["spec"]
    pod = deployment["template"]["spec"]
    (manager,) = pod["containers"]
    assert deployment["replicas"] == 1
    assert (
        manager["image"] == "sovereign.local/kind/lws:local" and manager["imagePullPolicy"] == "IfNotPresent"
    )
    assert manager["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532}


def test_lws_manifests_without_the_controller_stop_with_the_reason() -> None:
    proc = subprocess.run(
        [sys.executable, str(LOCAL / "lws_manifests.py"), "img"],
        input="kind: Namespace\nmetadata: {name: lws-system}\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "no Deployment lws-controller-manager" in proc.stderr


def node_manifests() -> list[dict]:
    """What a kind cluster on the local node image applies of ours, as build.sh and run.sh write it: the
    pod network and the default StorageClass (kind applies them from /kind/manifests), the fake GPU
    plugin, and the storage provisioner's helper pod (a Pod inside its ConfigMap)."""
    docs = []
    for name in ("podnet.yaml", "fakegpu.yaml"):
        text = (LOCAL / name).read_text().replace("image: IMAGE", f"image: sovereign.local/kind/{name}:local")
        docs += load_docs(text)
    storage = (LOCAL / "storage.yaml").read_text()
    storage = storage.replace("PROVISIONER_IMAGE", "sovereign.local/kind/local-path-provisioner:local")
    docs += load_docs(storage.replace("HELPER_IMAGE", "sovereign.local/kind/local-path-helper:local"))
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "local-path-config"]
    return [*docs, yaml.safe_load(config["data"]["helperPod.yaml"])]


def test_the_node_images_manifests_are_valid_for_its_kubernetes(
    kubeconform: str, swagger: dict, tmp_path: Path
) -> None:
    docs = node_manifests()
    assert not [d for d in docs if "IMAGE" in json.dumps(d)], "a placeholder build.sh replaces is left"
    kinds = {(d["apiVersion"], d["kind"]) for d in docs}
    assert write_builtin_schemas(swagger, kinds, tmp_path) == kinds
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    cmd = [kubeconform, "-strict", "-summary", "-kubernetes-version", kube_version().lstrip("v")]
    result = subprocess.run(
        [*cmd, "-schema-location", str(tmp_path / SCHEMA_LOCATION), str(manifests)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and f"Valid: {len(docs)}" in result.stdout, result.stdout + result.stderr


def test_the_default_storage_class_is_the_one_its_provisioner_serves() -> None:
    """kind's `standard` class, the default, bound where the pod lands, on the nodes' /var."""
    docs = node_manifests()
    (storage_class,) = [d for d in docs if d["kind"] == "StorageClass"]
    assert storage_class["metadata"]["name"] == "standard"
    assert storage_class["metadata"]["annotations"] == {"storageclass.kubernetes.io/is-default-class": "true"}
    assert (storage_class["provisioner"], storage_class["volumeBindingMode"]) == (
        "rancher.io/local-path",
        "WaitForFirstConsumer",
    )
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    paths = json.loads(config["data"]["config.json"])["nodePathMap"]
    assert paths == [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["/var/local-path-provisioner"]}]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (account,) = [
        d
        for d in docs
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == pod["serviceAccountName"]
    ]
    # The provisioner gives its helper pods the account the flag names: the same one.
    assert f"--service-account-name={account['metadata']['name']}" in pod["containers"][0]["command"]


def test_podnet_routes_other_nodes_pods_and_masquerades_what_leaves_the_pod_networks(tmp_path: Path) -> None:
    """podnet with stand-ins for kubectl, ip and iptables: two resync rounds over three nodes."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls"
    nat = tmp_path / "nat"  # the stand-in iptables' nat table: one rule per line, as `-S` prints them
    nat.write_text("")
    (stubs / "kubectl").write_text(
        "#!/bin/sh\nprintf 'w1 10.244.1.0/24 172.19.0.3\\ncp 10.244.0.0/24 172.19.0.2\\nw2 10.244.2.0/24 172.19.0.4\\n'\n"
    )
    (stubs / "ip").write_text(f'#!/bin/sh\necho "ip $*" >> {calls}\n')
    (stubs / "iptables").write_text(
        f"""#!/bin/bash
echo "iptables $*" >> {calls}
shift 2  # -t nat
op=$1; shift
rule="$*"
case $op in
  -N) grep -qx -- "-N $1" {nat} && exit 1; echo "-N $1" >> {nat} ;;
  -F) sed -i "/^-A $1 /d" {nat} ;;
  -A) echo "-A $rule" >> {nat} ;;
  -C) grep -qx -- "-A $rule" {nat} ;;
esac
"""
    )
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "NODE_NAME": "w1",
        "CNI_CONF_DIR": str(tmp_path / "cni"),
        "RESYNC_SECONDS": "0.5",
    }
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(["bash", str(LOCAL / "podnet")], env=env, capture_output=True, timeout=1.8)

    conf = json.loads((tmp_path / "cni" / "10-podnet.conflist").read_text())
    assert conf["plugins"][0]["ipam"]["ranges"] == [[{"subnet": "10.244.1.0/24"}]]
    done = calls.read_text().splitlines()
    assert "ip route replace 10.244.0.0/24 via 172.19.0.2" in done
    assert "ip route replace 10.244.2.0/24 via 172.19.0.4" in done
    # Every pod network is returned from, the rest masqueraded; only this node's pods jump there.
    assert nat.read_text().splitlines() == [
        "-N PODNET-MASQ",
        "-A PODNET-MASQ -d 10.244.1.0/24 -j RETURN",
        "-A PODNET-MASQ -d 10.244.0.0/24 -j RETURN",
        "-A PODNET-MASQ -d 10.244.2.0/24 -j RETURN",
        "-A PODNET-MASQ -j MASQUERADE",
        "-A POSTROUTING -s 10.244.1.0/24 -j PODNET-MASQ",
    ]
    # Later rounds with the same nodes only check that the jump is there.
    writes = [c for c in done if c.startswith("iptables") and " -C " not in c]
    assert len(writes) == 6, writes
    assert sum(1 for c in done if c == "iptables -t nat -C POSTROUTING -s 10.244.1.0/24 -j PODNET-MASQ") >= 2
