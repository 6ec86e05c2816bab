"""examples/gitops: the Argo CD Applications parse, point at real paths and order CRDs first."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml
from packaging_helpers import CHART, REPO

GITOPS = REPO / "examples" / "gitops"


def apps() -> dict[str, dict]:
    found = {}
    for path in sorted(GITOPS.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        for doc in docs:
            assert doc["apiVersion"] == "argoproj.io/v1alpha1" and doc["kind"] == "Application", path
            found[doc["metadata"]["name"]] = doc
    return found


def wave(app: dict) -> int:
    return int(app["metadata"].get("annotations", {}).get("argocd.argoproj.io/sync-wave", "0"))


def source_path(app: dict) -> Path:
    return REPO / app["spec"]["source"]["path"]


def test_chart_application_installs_the_chart_first():
    chart_app = apps()["sovereign"]
    assert source_path(chart_app) == CHART
    assert (source_path(chart_app) / "Chart.yaml").is_file()
    assert wave(chart_app) == -1
    assert "ServerSideApply=true" in chart_app["spec"]["syncPolicy"]["syncOptions"]
    # The chart's own values schema accepts the values the Application passes.
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    jsonschema.validate(chart_app["spec"]["source"]["helm"]["valuesObject"], schema)


def test_model_application_comes_after_the_crd():
    everything = apps()
    model_app = everything["sovereign-tiny"]
    assert wave(model_app) > wave(everything["sovereign"])
    options = model_app["spec"]["syncPolicy"]["syncOptions"]
    assert "ServerSideApply=true" in options
    assert "SkipDryRunOnMissingResource=true" in options
    include = model_app["spec"]["source"]["directory"]["include"]
    target = source_path(model_app) / include
    assert target.is_file(), f"{target} does not exist"
    (doc,) = [d for d in yaml.safe_load_all(target.read_text()) if d]
    assert doc["kind"] == "LLMDeployment" and doc["apiVersion"] == "sovereign.ai/v1alpha1"


def test_every_application_has_a_destination_and_automated_sync():
    for name, app in apps().items():
        spec = app["spec"]
        assert spec["destination"]["server"] and spec["destination"]["namespace"], name
        assert spec["source"]["repoURL"].endswith(".git"), name
        assert source_path(app).is_dir(), name
        assert spec["syncPolicy"]["automated"]["selfHeal"] is True, name


def test_app_of_apps_syncs_the_folder_without_itself():
    root = apps()["sovereign-root"]
    assert source_path(root) == GITOPS
    assert root["spec"]["source"]["directory"]["exclude"] == "app-of-apps.yaml"
