"""e2e/images/oci.py: the image archives the local cluster imports (no registry, no Docker engine)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def oci() -> ModuleType:
    spec = importlib.util.spec_from_file_location("oci", REPO / "e2e" / "images" / "oci.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tool").write_text("#!/bin/sh\necho hi\n")
    (root / "bin" / "tool").chmod(0o755)
    (root / "bin" / "alias").symlink_to("tool")
    (root / "bin" / "twin").hardlink_to(root / "bin" / "tool")
    (root / "etc").mkdir()
    (root / "etc" / "conf").write_text("x=1\n")
    return root


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_an_archive_is_an_oci_layout_and_a_docker_save_of_the_same_image(tmp_path: Path) -> None:
    m = oci()
    layer = m.write_layer(m.walk_tree(tree(tmp_path / "root")), tmp_path / "layer.tar")
    config = m.image_config([layer], env={"A": "1"}, entrypoint=["/bin/tool"], user="65532:65532")
    digest = m.write_image_archive(tmp_path / "img.tar", "ghcr.io/x/y:1.0", [layer], config)

    files = members(tmp_path / "img.tar")
    blob = lambda d: files[f"blobs/sha256/{d.split(':')[1]}"]  # noqa: E731
    # Every blob is named after its content.
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    index = json.loads(files["index.json"])
    (entry,) = index["manifests"]
    assert entry["digest"] == digest
    assert entry["annotations"]["io.containerd.image.name"] == "ghcr.io/x/y:1.0"
    manifest = json.loads(blob(digest))
    image_config = json.loads(blob(manifest["config"]["digest"]))
    assert image_config["rootfs"]["diff_ids"] == [layer.digest] == [manifest["layers"][0]["digest"]]
    assert image_config["config"]["User"] == "65532:65532"
    assert image_config["config"]["Entrypoint"] == ["/bin/tool"]
    (docker,) = json.loads(files["manifest.json"])
    assert docker["RepoTags"] == ["ghcr.io/x/y:1.0"]
    assert json.loads(files[docker["Config"]]) == image_config


def test_layers_are_deterministic_and_keep_links(tmp_path: Path) -> None:
    m = oci()
    first = m.write_layer(m.walk_tree(tree(tmp_path / "a"), prefix="opt"), tmp_path / "1.tar")
    second = m.write_layer(m.walk_tree(tree(tmp_path / "b"), prefix="opt"), tmp_path / "2.tar")
    assert first.digest == second.digest
    with tarfile.open(first.path) as tar:
        by_name = {x.name: x for x in tar.getmembers()}
    assert by_name["opt/bin/alias"].issym() and by_name["opt/bin/alias"].linkname == "tool"
    links = [x for x in (by_name["opt/bin/tool"], by_name["opt/bin/twin"]) if x.islnk()]
    assert len(links) == 1, "a hard-linked pair is stored once"
    assert by_name["opt/bin/tool"].mode & 0o777 in (0o755, 0o644) and by_name["opt/etc/conf"].uid == 0
    assert m.Layer.load(first.path) == first


def test_the_command_line_refuses_a_reference_without_a_tag(tmp_path: Path) -> None:
    m = oci()
    f = tmp_path / "pause"
    f.write_bytes(b"\x7fELF")
    with pytest.raises(ValueError, match="no tag"):
        m.main(["--ref", "registry.k8s.io/pause", "--file", f"{f}=/pause", "--out", str(tmp_path / "o.tar")])
    assert (
        m.main(
            ["--ref", "registry.k8s.io/pause:3.10", "--file", f"{f}=/pause", "--out", str(tmp_path / "o.tar")]
        )
        == 0
    )
    assert "blobs/sha256" in " ".join(members(tmp_path / "o.tar"))


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_walk_tree_keeps_owners_when_asked(tmp_path: Path) -> None:
    m = oci()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "shadow").write_text("x")
    os.chown(tmp_path / "etc" / "shadow", 0, 42)
    kept = {e.name: (e.uid, e.gid) for e in m.walk_tree(tmp_path, uid=None, gid=None)}
    forced = {e.name: (e.uid, e.gid) for e in m.walk_tree(tmp_path)}
    assert kept["etc/shadow"] == (0, 42) and forced["etc/shadow"] == (0, 0)


def test_a_layer_is_read_in_place_from_an_archive(tmp_path: Path) -> None:
    m = oci()
    layer = m.write_layer(m.walk_tree(tree(tmp_path / "root")), tmp_path / "layer.tar")
    config = m.image_config([layer])
    m.write_image_archive(tmp_path / "one.tar", "ghcr.io/x/y:1", [layer], config)
    inside = m.blob_in_archive(tmp_path / "one.tar", layer.digest)
    assert (
        inside is not None
        and inside.offset > 0
        and (inside.digest, inside.size) == (layer.digest, layer.size)
    )
    layer.path.unlink()
    # A second archive written from the first one's blob holds the same bytes.
    m.write_image_archive(tmp_path / "two.tar", "ghcr.io/x/y:2", [inside], config)
    files = members(tmp_path / "two.tar")
    blob = files[f"blobs/sha256/{layer.digest.split(':')[1]}"]
    assert hashlib.sha256(blob).hexdigest() == layer.digest.split(":")[1]
    assert m.blob_in_archive(tmp_path / "two.tar", "sha256:" + "0" * 64) is None
    assert m.blob_in_archive(tmp_path / "missing.tar", layer.digest) is None
