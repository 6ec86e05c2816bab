"""The install docs point at files and values that exist."""

from __future__ import annotations

import re

import pytest
import yaml
from packaging_helpers import CHART, REPO

DOCS = ["install.md", "gitops.md", "rdma.md", "troubleshooting.md"]
REPO_PATH = re.compile(r"`((?:charts|examples|e2e|images|crds|docs|tests)/[A-Za-z0-9_./{},-]+)`")


@pytest.mark.parametrize("doc", DOCS)
def test_paths_in_docs_exist(doc: str):
    text = (REPO / "docs" / doc).read_text()
    for path in REPO_PATH.findall(text):
        if "{" in path:  # e2e/kind/kind-{cpu,gpu}.yaml
            head, alts, tail = re.match(r"(.*)\{(.*)\}(.*)", path).groups()
            candidates = [f"{head}{a}{tail}" for a in alts.split(",")]
        else:
            candidates = [path]
        for candidate in candidates:
            assert (REPO / candidate.rstrip("/")).exists(), (
                f"docs/{doc} names {candidate}, which does not exist"
            )


def _has_value(dotted: str) -> bool:
    node = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


@pytest.mark.parametrize("doc", DOCS)
def test_chart_values_in_docs_exist(doc: str):
    text = (REPO / "docs" / doc).read_text()
    named = set(
        re.findall(
            r"`((?:image|runtimeImage|operator|health|metrics|grafanaDashboard|argocd|rdma)\.[A-Za-z.]+)`",
            text,
        )
    )
    named |= set(
        re.findall(
            r"--set ((?:image|runtimeImage|operator|metrics|grafanaDashboard|argocd|rdma)\.[A-Za-z.]+)=", text
        )
    )
    for value in named:
        assert _has_value(value), f"docs/{doc} names chart value {value}, which values.yaml lacks"
