"""The local image build's pure parts (e2e/images/): Dockerfile reading, the dependency closure from
the virtualenv's metadata, wheel installation, bytecode, the CPU rules and the runc spec.

No root, no build: these run in a few seconds. tests/packaging/test_local_images.py builds and runs
the images.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib
import io
import os
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from packaging_helpers import REPO

IMAGES_DIR = REPO / "e2e" / "images"
SITE = Path(distribution("torch").locate_file("")).resolve()


def images_module(name: str) -> ModuleType:
    """A module of e2e/images (they import each other by plain name, as build.py runs them)."""
    if str(IMAGES_DIR) not in sys.path:
        sys.path.insert(0, str(IMAGES_DIR))
    return importlib.import_module(name)


# ---- Dockerfiles ----------------------------------------------------------------------------------


def test_the_runtime_dockerfile_reads_as_the_image_must_run() -> None:
    dockerfile = images_module("dockerfile")
    stage = dockerfile.final_stage(REPO / "images" / "runtime.Dockerfile")
    assert stage.entrypoint == ["sovereign-runtime"]
    assert stage.cmd is not None and stage.cmd[:3] == ["serve", "--model", "builtin:sovereign-tiny"]
    assert stage.user == "65532:65532" and stage.exposed_ports == ["8000"] and stage.workdir == "/"
    # $PATH expands against the base image's PATH.
    assert stage.env["PATH"] == "/opt/venv/bin:" + dockerfile.BASE_ENV["PATH"]
    assert stage.env["HOME"] == "/home/sovereign"
    assert stage.env["TRITON_CACHE_DIR"] == "/var/cache/sovereign/jit/triton"
    (account,) = stage.accounts
    assert (account.name, account.uid, account.gid, account.home, account.create_home) == (
        "sovereign",
        65532,
        65532,
        "/home/sovereign",
        True,
    )
    owners = {d.path: (d.uid, d.gid) for d in stage.directories}
    # chown -R reaches the parents mkdir -p made below it, not /var/cache itself.
    assert owners["/var/cache/sovereign"] == owners["/var/cache/sovereign/jit/inductor"] == (65532, 65532)
    assert owners["/var/cache"] == (0, 0)
    assert owners["/home/sovereign"] == (65532, 65532)
    assert any(step.startswith("apt-get") for step in stage.replaced)


def test_the_operator_dockerfile_reads_as_the_image_must_run() -> None:
    dockerfile = images_module("dockerfile")
    stage = dockerfile.final_stage(REPO / "images" / "operator.Dockerfile")
    assert stage.entrypoint == ["sovereign-operator", "run"] and stage.cmd is None
    assert stage.user == "65532:65532" and stage.exposed_ports == ["8080"]
    (account,) = stage.accounts
    assert account.home == "/nonexistent" and not account.create_home
    assert stage.directories == []


def test_both_dockerfiles_build_from_the_same_context() -> None:
    dockerfile = images_module("dockerfile")
    sources = [
        dockerfile.context_sources(REPO / "images" / n) for n in ("runtime.Dockerfile", "operator.Dockerfile")
    ]
    assert sources[0] == sources[1] == ["pyproject.toml", "README.md", "operator", "runtime"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ("RUN curl -sL https://example.com/x.sh | sh", "only `&&` chains"),
        ("RUN make install", "no equivalent for `make install`"),
        ("RUN useradd --uid 10 x", "needs a numeric --uid, a --gid"),
        ("RUN groupadd --gid 10 g && useradd --uid 10 --gid 11 x", "no groupadd created that group"),
        ("ENV A=${B:-c}", "unsupported substitution"),
        ("HEALTHCHECK CMD true", "HEALTHCHECK is not supported"),
        ("ENTRYPOINT sovereign-runtime serve", "exec (JSON array) form"),
    ],
)
def test_what_the_local_build_cannot_reproduce_stops_it(tmp_path: Path, lines: str, message: str) -> None:
    dockerfile = images_module("dockerfile")
    path = tmp_path / "x.Dockerfile"
    path.write_text(f"FROM debian:12.5\n{lines}\n")
    with pytest.raises(dockerfile.DockerfileError, match=r"x\.Dockerfile") as err:
        dockerfile.final_stage(path)
    assert message in str(err.value)


def test_env_forms_and_substitution(tmp_path: Path) -> None:
    dockerfile = images_module("dockerfile")
    path = tmp_path / "x.Dockerfile"
    path.write_text(
        "FROM a:1.0 AS build\nENV IGNORED=1\nFROM b:2.0\nENV A=1 \\\n    B=$A/x\nENV C two words\nENV D=$A/y\n"
        'ENV PATH=/opt/bin:${PATH}\nWORKDIR /srv\nWORKDIR app\nCMD ["x"]\nENTRYPOINT ["y"]\n'
    )
    stage = dockerfile.final_stage(path)
    assert "IGNORED" not in stage.env
    # As in Docker, one ENV instruction substitutes from the environment before it.
    assert (stage.env["A"], stage.env["B"], stage.env["C"], stage.env["D"]) == ("1", "/x", "two words", "1/y")
    assert stage.env["PATH"].startswith("/opt/bin:/usr/local/sbin")
    assert stage.workdir == "/srv/app"
    assert stage.entrypoint == ["y"] and stage.cmd is None  # ENTRYPOINT after CMD resets it, as in Docker


# ---- the Python environment -----------------------------------------------------------------------


def _closure(extras: tuple[str, ...]) -> set[str]:
    pyenv = images_module("pyenv")
    requirements = distribution("sovereign").requires or []
    closure = pyenv.resolve(
        requirements, pyenv.installed(SITE), pyenv.marker_environment("3.11.2"), extras=extras
    )
    return set(closure.dists)


def test_the_runtime_closure_follows_extras_and_markers() -> None:
    names = _closure(("runtime",))
    assert {
        "torch",
        "triton",
        "numpy",
        "xgrammar",
        "transformers",
        "safetensors",
        "kopf",
        "lightkube",
    } <= names
    # torch's cuda-toolkit[cublas,...] extra brings the CUDA component wheels.
    assert {"cuda-toolkit", "nvidia-cublas", "nvidia-cufft", "nvidia-cudnn-cu13"} <= names
    # Test and rdma extras stay out.
    assert not names & {"pytest", "ruff", "openai", "matplotlib", "nixl", "sovereign"}


def test_the_operator_closure_has_no_torch() -> None:
    names = _closure(())
    assert {"kopf", "lightkube", "pydantic", "aiohttp", "prometheus-client", "pyyaml"} <= names
    assert {"h2", "wsproto"} <= names, "lightkube's httpx2[http2,ws] extras are followed"
    assert not names & {"torch", "numpy", "triton", "transformers"}


def _fake_dist(site: Path, name: str, version: str, requires: list[str]) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text(f"{name}-{version}.dist-info/METADATA,,\n")


def test_a_missing_or_mismatched_distribution_names_who_needs_it(tmp_path: Path) -> None:
    pyenv = images_module("pyenv")
    _fake_dist(tmp_path, "a", "1.0", ["b>=2", 'c; extra == "x"', 'd; python_version < "3.0"'])
    _fake_dist(tmp_path, "b", "1.5", [])
    env = pyenv.marker_environment("3.11.2")
    with pytest.raises(pyenv.ClosureError, match=r"b 1\.5 is installed but a 1\.0 needs b>=2"):
        pyenv.resolve(["a"], pyenv.installed(tmp_path), env)
    (tmp_path / "b-1.5.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: b\nVersion: 2.0\n")
    closure = pyenv.resolve(["a"], pyenv.installed(tmp_path), env)
    assert set(closure.dists) == {"a", "b"}, "markers false for the image (extra, python_version) skip"
    with pytest.raises(pyenv.ClosureError, match=r"c; extra == \"x\" \(needed by a 1\.0\) is not installed"):
        pyenv.resolve(["a[x]"], pyenv.installed(tmp_path), env)


def _wheel(tmp_path: Path) -> Path:
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("demo/__init__.py", "def main():\n    print('demo says hi')\n    return 0\n")
        zf.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
        zf.writestr("demo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
        zf.writestr("demo-1.0.dist-info/entry_points.txt", "[console_scripts]\ndemo-cli = demo:main\n")
        zf.writestr("demo-1.0.dist-info/RECORD", "stale,,\n")
        info = zipfile.ZipInfo("demo-1.0.data/scripts/tool")
        info.external_attr = 0o755 << 16
        zf.writestr(info, "#!/bin/sh\necho tool\n")
    return path


def test_a_wheel_installs_into_the_image_venv_as_pip_would(tmp_path: Path) -> None:
    pyenv = images_module("pyenv")
    layout = pyenv.Layout("3.11.2")
    files = {s.path: s for s in pyenv.install_wheel(_wheel(tmp_path), layout)}
    site = "/opt/venv/lib/python3.11/site-packages"
    assert set(files) == {
        f"{site}/demo/__init__.py",
        f"{site}/demo-1.0.dist-info/METADATA",
        f"{site}/demo-1.0.dist-info/WHEEL",
        f"{site}/demo-1.0.dist-info/entry_points.txt",
        f"{site}/demo-1.0.dist-info/INSTALLER",
        f"{site}/demo-1.0.dist-info/RECORD",
        "/opt/venv/bin/tool",
        "/opt/venv/bin/demo-cli",
    }
    assert files["/opt/venv/bin/tool"].mode == 0o755
    launcher = files["/opt/venv/bin/demo-cli"]
    assert launcher.mode == 0o755 and launcher.data.startswith(b"#!/opt/venv/bin/python\n")
    # RECORD is rewritten: every installed file with its hash and size, paths relative to site-packages.
    rows = {
        r[0]: r for r in csv.reader(io.StringIO(files[f"{site}/demo-1.0.dist-info/RECORD"].data.decode()))
    }
    for path, script in files.items():
        rel = os.path.relpath(path, site)
        if rel.endswith("RECORD"):
            assert rows[rel][1:] == ["", ""]
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(script.data).digest()).rstrip(b"=").decode()
        assert rows[rel] == [rel, f"sha256={digest}", str(len(script.data))]
    # The launcher runs the entry point.
    staged = tmp_path / "site"
    (staged / "demo").mkdir(parents=True)
    (staged / "demo" / "__init__.py").write_bytes(files[f"{site}/demo/__init__.py"].data)
    script = tmp_path / "demo-cli"
    script.write_bytes(launcher.data)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(staged)},
        check=True,
    )
    assert out.stdout == "demo says hi\n"


def test_console_scripts_of_the_virtualenv_get_the_image_interpreter() -> None:
    pyenv = images_module("pyenv")
    host = Path("/work/x/.venv/bin/python")
    simple = b"#!/work/x/.venv/bin/python\nimport sys\n"
    assert (
        pyenv.rewrite_shebang(simple, host, "/opt/venv/bin/python") == b"#!/opt/venv/bin/python\nimport sys\n"
    )
    long_form = b"#!/bin/sh\n'''exec' '/work/x/.venv/bin/python' \"$0\" \"$@\"\n' '''\nimport sys\n"
    assert (
        pyenv.rewrite_shebang(long_form, host, "/opt/venv/bin/python")
        == b"#!/opt/venv/bin/python\nimport sys\n"
    )
    assert pyenv.rewrite_shebang(b"\x7fELF...", host, "/opt/venv/bin/python") is None
    assert pyenv.rewrite_shebang(b"#!/bin/sh\necho\n", host, "/opt/venv/bin/python") is None


def test_record_paths_must_stay_in_the_venv() -> None:
    pyenv = images_module("pyenv")
    layout = pyenv.Layout("3.11.2")
    assert pyenv.image_path(layout, "../../../bin/torchrun") == "/opt/venv/bin/torchrun"
    with pytest.raises(pyenv.ClosureError, match="outside /opt/venv"):
        pyenv.image_path(layout, "../../../../../etc/passwd")


def test_bytecode_is_unchecked_hash_and_names_the_image_path(tmp_path: Path) -> None:
    pyenv = images_module("pyenv")
    layout = pyenv.Layout("3.11.2")
    source = tmp_path / "mod.py"
    source.write_text("VALUE = 42\n")
    broken = tmp_path / "tpl.py"
    broken.write_text("{% if x %}not python{% endif %}\n")
    image = f"{layout.site}/pkg/mod.py"
    compiled, invalid = pyenv.compile_sources(
        {image: source, f"{layout.site}/pkg/tpl.py": broken}, tmp_path / "out", layout, workers=1
    )
    assert invalid == [f"{layout.site}/pkg/tpl.py"]
    (pyc,) = compiled.values()
    assert list(compiled) == [f"{layout.site}/pkg/__pycache__/mod.cpython-311.pyc"]
    data = pyc.read_bytes()
    assert int.from_bytes(data[4:8], "little") == 0b01, "hash-based, not checked against the source"
    import marshal

    code = marshal.loads(data[16:])
    assert code.co_filename == image


# ---- ELF and the CPU flavour ----------------------------------------------------------------------


def test_elf_dynamic_section_is_read_as_the_loader_reads_it(tmp_path: Path) -> None:
    elf = images_module("elf")
    info = elf.read_dynamic(SITE / "torch" / "lib" / "libtorch.so")
    assert "libtorch_cpu.so" in info.needed and "libc.so.6" in info.needed
    assert "$ORIGIN" in info.runpath
    assert elf.expand_origin("${ORIGIN}/../x", "torch/lib") == "torch/lib/../x"
    text = tmp_path / "x.so"
    text.write_text("not an elf")
    assert not elf.is_elf(text)
    with pytest.raises(elf.ElfError, match="not an ELF"):
        elf.read_dynamic(text)


# torch/__init__.py preloads these when present, best effort; nothing needs them on a CPU.
BEST_EFFORT_PRELOADS = ("libcusolver.so", "libnvJitLink.so", "libnvrtc-builtins.so")


def test_the_cpu_flavour_keeps_every_library_import_torch_maps() -> None:
    """The rule (DT_NEEDED closure) against the measurement (/proc/self/maps after import torch)."""
    pyenv = images_module("pyenv")
    lean = images_module("lean")
    layout = pyenv.Layout("3.11.2")
    closure = pyenv.resolve(
        distribution("sovereign").requires or [],
        pyenv.installed(SITE),
        pyenv.marker_environment("3.11.2"),
        extras=("runtime",),
    )
    files: dict[str, Path] = {}
    owner: dict[str, str] = {}
    for name, dist in closure.dists.items():
        copied, _scripts = pyenv.dist_files(dist, layout, Path(sys.executable))
        for target, source in copied.items():
            rel = os.path.relpath(target, layout.site)
            files[rel], owner[rel] = source, name
    selection = lean.select_cpu(files, owner)
    maps = subprocess.run(
        [sys.executable, "-c", "import torch; print(open('/proc/self/maps').read())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    paths = {fields[5] for fields in (line.split() for line in maps.splitlines()) if len(fields) >= 6}
    mapped = {os.path.relpath(p, SITE) for p in paths if p.startswith(f"{SITE}/")}
    assert mapped, "import torch mapped nothing from site-packages?"
    lost = {
        m for m in mapped if m not in selection.kept and not m.split("/")[-1].startswith(BEST_EFFORT_PRELOADS)
    }
    assert not lost, f"the CPU flavour drops libraries import torch maps: {sorted(lost)}"
    assert "nvidia/cu13/lib/libcublasLt.so.13" in selection.kept  # DT_NEEDED by libtorch_cuda.so
    assert "nvidia/cudnn/lib/libcudnn_engines_precompiled.so.9" in selection.dropped  # dlopened on GPUs
    assert any(rel.startswith("triton/") for rel in selection.dropped)
    kept = sum(files[r].stat().st_size for r in selection.kept)
    total = sum(files[r].stat().st_size for r in files)
    assert kept < 0.7 * total
    system = {
        p.name for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu") for p in Path(d).iterdir()
    }
    assert lean.missing_libraries(selection.kept, system, skip=frozenset()) == {}


def test_missing_libraries_names_the_object_and_the_library(tmp_path: Path) -> None:
    lean = images_module("lean")
    libtorch = SITE / "torch" / "lib" / "libtorch.so"
    missing = lean.missing_libraries(
        {"torch/lib/libtorch.so": libtorch}, {"libc.so.6", "libgcc_s.so.1", "libpthread.so.0"}
    )
    assert missing == {"torch/lib/libtorch.so": ["libtorch_cpu.so", "libtorch_cuda.so"]}


# ---- running an image -----------------------------------------------------------------------------


def test_command_and_args_follow_kubernetes_rules() -> None:
    run_image = images_module("run_image")
    image = {"config": {"Entrypoint": ["ep"], "Cmd": ["c1", "c2"]}}
    assert run_image.process_args(image, None, None) == ["ep", "c1", "c2"]
    assert run_image.process_args(image, None, ["a"]) == ["ep", "a"]
    assert run_image.process_args(image, ["cmd"], None) == ["cmd"]
    assert run_image.process_args(image, ["cmd"], ["a"]) == ["cmd", "a"]
    with pytest.raises(run_image.RunError, match="names a command"):
        run_image.process_args({"config": {}}, None, None)


def _rendered_tiny() -> list[dict]:
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "sovereign-operator"),
            "render",
            "-f",
            str(REPO / "examples" / "tiny.yaml"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_rendered_pod_becomes_a_locked_down_container(tmp_path: Path) -> None:
    run_image = images_module("run_image")
    docs = _rendered_tiny()
    config_maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    fields = {"metadata.name": "tiny-0", "metadata.namespace": "default", "status.podIP": "10.0.0.5"}
    container = run_image.container_from_pod(pod, "runtime", config_maps, fields)
    assert container.command == ["sovereign-runtime"] and container.args and container.args[0] == "serve"
    assert container.env["POD_NAME"] == "tiny-0" and container.env["SOVEREIGN_DEPLOYMENT"] == "tiny"
    assert (container.run_as_user, container.run_as_group, container.fs_group) == (65532, 65532, 65532)
    assert container.read_only_root and container.run_as_non_root
    assert {"/tmp", "/dev/shm", "/var/cache/sovereign/jit", "/home/sovereign/.cache"} <= set(
        container.empty_dirs
    )
    image = {"config": {"User": "65532:65532", "Env": ["PATH=/opt/venv/bin:/usr/bin", "POD_NAME=image"]}}
    spec = run_image.runc_config(image, tmp_path / "rootfs", container, tmp_path / "bundle")
    process = spec["process"]
    assert process["user"] == {"uid": 65532, "gid": 65532}
    assert process["args"] == [*container.command, *container.args]
    assert "POD_NAME=tiny-0" in process["env"] and "PATH=/opt/venv/bin:/usr/bin" in process["env"]
    assert process["noNewPrivileges"] and not any(process["capabilities"].values())
    assert spec["root"]["readonly"]
    binds = {m["destination"]: m for m in spec["mounts"] if m["type"] == "bind"}
    assert set(container.empty_dirs) | {"/etc/hosts", "/etc/hostname"} == set(binds)
    assert {"type": "network"} in spec["linux"]["namespaces"]
    joined = run_image.runc_config(image, tmp_path / "r", container, tmp_path / "b", net_ns="/proc/1/ns/net")
    assert {"type": "network", "path": "/proc/1/ns/net"} in joined["linux"]["namespaces"]
    root_image = {"config": {"User": "0"}}
    with pytest.raises(run_image.RunError, match="runAsNonRoot"):
        run_image.runc_config(
            root_image, tmp_path / "r", run_image.PodContainer(run_as_non_root=True), tmp_path
        )


def test_only_debian_sources_of_the_suite_reach_the_image(tmp_path: Path) -> None:
    rootfs = images_module("rootfs")
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n"
    )
    (tmp_path / "sources.list.d" / "docker.list").write_text(
        "deb https://download.docker.com/linux/debian bookworm stable\n"
        "deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n"
    )
    (tmp_path / "sources.list").write_text(
        "deb http://deb.debian.org/debian-security bookworm-security main\n"
    )
    found = rootfs.debian_sources(tmp_path)
    assert [s["URIs"] for s in found] == [
        "http://deb.debian.org/debian",
        "http://deb.debian.org/debian-security",
    ]


def test_debian_sources_are_read_in_both_formats() -> None:
    rootfs = images_module("rootfs")
    stanzas = rootfs.parse_deb822(
        "# comment\nTypes: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\n"
        "Suites: bookworm-security\nComponents: main\nEnabled: no\n"
    )
    assert len(stanzas) == 1 and rootfs.main_mirror(stanzas) == "http://deb.debian.org/debian"
    lines = rootfs.parse_one_line(
        "deb [signed-by=/k.gpg arch=amd64] http://m/debian-security bookworm-security main\n"
    )
    assert lines == [
        {
            "Types": "deb",
            "URIs": "http://m/debian-security",
            "Suites": "bookworm-security",
            "Components": "main",
            "Signed-By": "/k.gpg",
        }
    ]
    with pytest.raises(rootfs.BaseError, match="no apt source for Debian bookworm"):
        rootfs.main_mirror(lines)
