"""The README is the first thing a user runs: its commands and its example must stay true."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one() -> None:
    head = "\n".join(README.splitlines()[:10])
    assert "make demo" in head and "make test" in head
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_readme_example_is_a_valid_llmdeployment(tmp_path: Path) -> None:
    block = re.search(r"```yaml\n(.*?)```", README, re.S)
    assert block is not None
    manifest = tmp_path / "example.yaml"
    manifest.write_text(block.group(1))
    assert yaml.safe_load(block.group(1))["kind"] == "LLMDeployment"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sovereign_operator.cli",
            "render",
            "-f",
            str(manifest),
            "--rdma-nodes",
            "yes",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc]
    assert kinds.count("StatefulSet") == 2  # prefill and decode: `auto` resolved to disaggregated


def test_readme_links_point_at_files_that_exist() -> None:
    for target in re.findall(r"\]\(((?:docs|examples|charts)/[^)#]+)\)", README):
        assert (ROOT / target).exists(), target
