"""Fixtures of the packaging tests: helm, kubeconform and the pinned release's swagger.json."""

from __future__ import annotations

import json

import pytest
from packaging_helpers import find_tool, kube_version, swagger_path, unavailable


@pytest.fixture(scope="session")
def helm() -> str:
    return find_tool("helm")


@pytest.fixture(scope="session")
def kubeconform() -> str:
    return find_tool("kubeconform")


@pytest.fixture(scope="session")
def swagger() -> dict:
    path = swagger_path()
    if path is None:
        unavailable(f"swagger.json of k8s.io/kubernetes@{kube_version()} not in the Go module cache")
    return json.loads(path.read_text())
