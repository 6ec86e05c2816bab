"""Static checks of the Dockerfiles (no Docker engine here): a small hadolint of our own.

Every COPY source exists and survives .dockerignore, bases are pinned, the final USER is a
numeric non-root id, entrypoints are console scripts pyproject.toml declares, and the runtime's
JIT cache folders are the ones the operator points its env vars at.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging_helpers import REPO

IMAGES = {p.name: p for p in sorted((REPO / "images").glob("*.Dockerfile"))}
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def args_of(path: Path) -> dict[str, str]:
    found = {}
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            found[name] = value
    return found


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (w, _) in enumerate(steps) if w == "FROM")
    return steps[last_from:]


def dockerignore_keeps(rel: str) -> bool:
    """Whether the build context keeps `rel`, with Docker's last-match-wins pattern semantics."""
    keep = True
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        candidates = [rel, *[str(Path(*Path(rel).parts[:i])) for i in range(1, len(Path(rel).parts))]]
        if any(
            fnmatch.fnmatch(c, pattern) or fnmatch.fnmatch(c, pattern.replace("**/", "")) for c in candidates
        ):
            keep = negate
    return keep


def test_both_images_exist():
    assert set(IMAGES) == {"operator.Dockerfile", "runtime.Dockerfile"}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_copy_sources_exist_in_the_context(name: str):
    for word, rest in instructions(IMAGES[name]):
        if word != "COPY" or "--from=" in rest:
            continue
        sources = [s for s in shlex.split(rest) if not s.startswith("--")][:-1]
        assert sources, rest
        for source in sources:
            assert (REPO / source).exists(), f"{name}: COPY {source} does not exist"
            assert dockerignore_keeps(source.rstrip("/")), f"{name}: .dockerignore drops {source}"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_base_images_are_pinned(name: str):
    args = args_of(IMAGES[name])
    for word, rest in instructions(IMAGES[name]):
        if word != "FROM":
            continue
        image = rest.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if (
            "/" not in image
            and ":" not in image
            and image
            in {r.split()[-1] for w, r in instructions(IMAGES[name]) if w == "FROM" and " AS " in r.upper()}
        ):
            continue  # a named build stage
        assert ":" in image.split("/")[-1] or "@sha256:" in image, f"{name}: {image} has no tag"
        tag = image.split("@")[0].rsplit(":", 1)[1]
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: {image} is not pinned to a version"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_runs_as_numeric_non_root_user(name: str):
    users = [rest for word, rest in final_stage(IMAGES[name]) if word == "USER"]
    assert users, f"{name}: the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{name}: USER {users[-1]} must be a numeric non-root id"


def entrypoint(name: str) -> list[str]:
    (rest,) = [r for w, r in final_stage(IMAGES[name]) if w == "ENTRYPOINT"]
    return json.loads(rest)  # exec form: signals reach the process


def test_operator_entrypoint_is_its_console_script():
    assert entrypoint("operator.Dockerfile") == ["sovereign-operator", "run"]
    assert SCRIPTS["sovereign-operator"] == "sovereign_operator.cli:main"


def test_runtime_entrypoint_is_its_console_script():
    assert entrypoint("runtime.Dockerfile") == ["sovereign-runtime"]
    assert "sovereign-runtime" in SCRIPTS
    (cmd,) = [json.loads(r) for w, r in final_stage(IMAGES["runtime.Dockerfile"]) if w == "CMD"]
    # The default command parses with the runtime's own CLI.
    from sovereign_runtime.program import build_parser

    parsed = build_parser().parse_args(cmd)
    assert parsed.command == "serve" and parsed.port == 8000 and parsed.host == "0.0.0.0"
    assert parsed.model.startswith("builtin:")


def test_operator_image_has_no_runtime_extra():
    text = " ".join(r for w, r in instructions(IMAGES["operator.Dockerfile"]) if w == "RUN")
    assert "[runtime]" not in text and "torch" not in text


def test_runtime_image_installs_torch_and_the_runtime_extra():
    text = " ".join(r for w, r in instructions(IMAGES["runtime.Dockerfile"]) if w == "RUN")
    assert "torch==" in text and '".[runtime]"' in text
    assert args_of(IMAGES["runtime.Dockerfile"])["CUDA_IMAGE"].startswith("nvidia/cuda:")


def test_no_add_no_sudo_no_apt_cache():
    for name, path in IMAGES.items():
        for word, rest in instructions(path):
            assert word != "ADD", f"{name}: use COPY (ADD fetches URLs and unpacks archives)"
            if word == "RUN":
                assert "sudo " not in rest, name
                if "apt-get install" in rest:
                    assert "--no-install-recommends" in rest and "rm -rf /var/lib/apt/lists" in rest, name
                if "pip install" in rest:
                    assert "PIP_NO_CACHE_DIR=1" in path.read_text() or "--no-cache-dir" in rest, name


def test_runtime_jit_cache_matches_the_operator():
    from sovereign_operator.render import children

    env = {}
    for word, rest in final_stage(IMAGES["runtime.Dockerfile"]):
        if word == "ENV":
            env.update(dict(pair.split("=", 1) for pair in shlex.split(rest)))
    rendered = {
        "TRITON_CACHE_DIR": f"{children.JIT_CACHE_MOUNT}/triton",
        "TORCHINDUCTOR_CACHE_DIR": f"{children.JIT_CACHE_MOUNT}/inductor",
        "DG_JIT_CACHE_DIR": f"{children.JIT_CACHE_MOUNT}/deepgemm",
    }
    source = Path(children.__file__).read_text()
    for name, value in rendered.items():
        assert name in source, f"the operator no longer sets {name}"
        assert env[name] == value
    runs = " ".join(r for w, r in final_stage(IMAGES["runtime.Dockerfile"]) if w == "RUN")
    for value in rendered.values():
        assert value in runs, f"{value} is not created in the image"
    assert "chown -R 65532:65532 /var/cache/sovereign" in runs


def test_dockerignore_keeps_the_context_small():
    for kept in (
        "pyproject.toml",
        "README.md",
        "operator/sovereign_operator/cli.py",
        "runtime/sovereign_runtime",
    ):
        assert dockerignore_keeps(kept), kept
    for dropped in (
        ".venv/bin/python",
        "e2e/cluster/bin/helm",
        ".git/config",
        "tests/conftest.py",
        ".cluster/kubeconfig",
    ):
        assert not dockerignore_keeps(dropped), dropped
    assert not dockerignore_keeps("operator/sovereign_operator/__pycache__/x.pyc")
