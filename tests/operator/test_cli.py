"""The `sovereign-operator` CLI: crd, render, and one-line errors for invalid specs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sovereign_operator.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "llmd.yaml"
    path.write_text(text)
    return str(path)


def test_crd_prints_the_committed_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == (REPO / "crds" / "sovereign.ai_llmdeployments.yaml").read_text()


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_examples_render(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(example), "--rdma-nodes", "yes"]) == 0
    children = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = {c["kind"] for c in children}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    # Pools are StatefulSets, or LeaderWorkerSets when a replica spans several nodes.
    assert kinds & {"StatefulSet", "LeaderWorkerSet"}


def test_the_h100_example_spans_two_nodes_per_replica(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(REPO / "examples" / "deepseek-v3-h100.yaml")]) == 0
    children = list(yaml.safe_load_all(capsys.readouterr().out))
    groups = {c["metadata"]["name"]: c for c in children if c["kind"] == "LeaderWorkerSet"}
    assert set(groups) == {"deepseek-v3-h100-prefill-group", "deepseek-v3-h100-decode-group"}
    assert not any(c["kind"] == "StatefulSet" for c in children)
    leader = groups["deepseek-v3-h100-decode-group"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    container = leader["spec"]["containers"][0]
    args = container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert args[args.index("--pipeline-parallel-size") + 1] == "2" and args[args.index("--nnodes") + 1] == "2"
    assert leader["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def test_flagship_example_is_disaggregated_on_h200_with_rdma(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(REPO / "examples" / "deepseek-v3-pd.yaml")]) == 0
    children = list(yaml.safe_load_all(capsys.readouterr().out))
    statefulsets = {c["metadata"]["name"]: c for c in children if c["kind"] == "StatefulSet"}
    assert set(statefulsets) == {"deepseek-v3-prefill", "deepseek-v3-decode"}
    container = statefulsets["deepseek-v3-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["args"][container["args"].index("--max-model-len") + 1] == "65536"
    assert container["args"][container["args"].index("--kv-transport") + 1] == "rdma"


def test_rdma_nodes_flag_decides_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (REPO / "examples" / "deepseek-v3-pd.yaml").read_text()
    text = text.replace("mode: disaggregated", "mode: auto").replace('enabled: "true"', 'enabled: "auto"')
    path = _write(tmp_path, text)
    for flag, pools in (
        ("yes", {"deepseek-v3-prefill", "deepseek-v3-decode"}),
        ("no", {"deepseek-v3-unified"}),
    ):
        assert main(["render", "-f", path, "--rdma-nodes", flag]) == 0
        children = list(yaml.safe_load_all(capsys.readouterr().out))
        assert {c["metadata"]["name"] for c in children if c["kind"] == "StatefulSet"} == pools


INVALID = [
    ("rdma: {enabled: true}", "spec.networking.rdma.enabled", "'auto', 'true' or 'false'"),
    ("mode: sideways", "spec.mode", "'unified', 'disaggregated' or 'auto'"),
    ("decode: {replicas: -1}", "spec.decode.replicas", "greater than or equal to 0"),
    ("decode: {replicas: 1, autoscaling: {maxReplicas: 2}}", "spec.decode", "either replicas or autoscaling"),
    ("prefill: {replicas: 1}", "spec", "remove prefill"),
]


@pytest.mark.parametrize(("extra", "field", "hint"), INVALID, ids=[i[1] + ":" + i[2][:12] for i in INVALID])
def test_invalid_spec_exits_non_zero_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, field: str, hint: str
) -> None:
    networking = extra.startswith("rdma")
    body = f"  networking: {{{extra}}}" if networking else f"  {extra}"
    path = _write(
        tmp_path,
        "apiVersion: sovereign.ai/v1alpha1\nkind: LLMDeployment\nmetadata: {name: t}\nspec:\n"
        "  model: {name: t, source: {builtin: sovereign-tiny}}\n  mode: unified\n" + body + "\n",
    )
    if extra.startswith("mode"):
        path = _write(tmp_path, Path(path).read_text().replace("  mode: unified\n", ""))
    assert main(["render", "-f", path]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert f": {field}: " in lines[0] and hint in lines[0]


def test_bad_name_and_kind_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = "spec: {model: {name: t, source: {builtin: sovereign-tiny}}}\n"
    path = _write(
        tmp_path, "apiVersion: sovereign.ai/v1alpha1\nkind: LLMDeployment\nmetadata: {name: 9Bad}\n" + spec
    )
    assert main(["render", "-f", path]) == 1
    assert "metadata.name" in capsys.readouterr().err
    path = _write(tmp_path, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert main(["render", "-f", path]) == 1
    assert "sovereign.ai/v1alpha1 LLMDeployment" in capsys.readouterr().err


def test_spec_examples_in_the_api_docs_are_valid() -> None:
    from sovereign_operator.api.document import parse_spec

    text = (REPO / "docs" / "api.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```yaml\n")[1:]]
    assert len(blocks) >= 2
    for block in blocks:
        parse_spec(yaml.safe_load(block)["spec"])


def _alias_bomb(levels: int = 10) -> str:
    """Each level lists the one before nine times: nine to the tenth "lol"s once expanded."""
    lines = ["apiVersion: sovereign.ai/v1alpha1", "kind: LLMDeployment", "metadata: {name: t}", "spec:"]
    lines.append("  l0: &l0 [" + ", ".join(["lol"] * 9) + "]")
    for level in range(1, levels):
        lines.append(f"  l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("content", "hint"),
    [
        (_alias_bomb().encode(), "aliases (*name) expand the document beyond"),
        (b"[" * 20_000, "nested more than 64 levels deep"),
        (b"a: &a [*a]\n", "refers to its own anchor"),
        (b"apiVersion: \xff\xfe\n", "not UTF-8 text: byte 12 is 0xff"),
    ],
    ids=["alias-bomb", "deep-nesting", "recursive-alias", "non-utf8"],
)
def test_hostile_yaml_ends_in_one_line_and_a_non_zero_exit_promptly(
    tmp_path: Path, content: bytes, hint: str
) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(content)
    # A subprocess with a deadline: the alias bomb hung `render` for over a minute at 2.2 GB.
    result = subprocess.run(
        [sys.executable, "-m", "sovereign_operator.cli", "render", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and hint in lines[0], result.stderr


def test_a_yaml_anchor_used_a_few_times_still_renders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path,
        "apiVersion: sovereign.ai/v1alpha1\nkind: LLMDeployment\nmetadata: {name: t}\nspec:\n"
        "  model: {name: t, source: {builtin: sovereign-tiny}}\n"
        "  runtime: {resources: &res {requests: {cpu: 1}}}\n  router: {resources: *res}\n",
    )
    assert main(["render", "-f", path]) == 0
    assert "StatefulSet" in capsys.readouterr().out


@pytest.mark.parametrize("namespace", ["../../kube-system", "Kube-System", "a" * 64, "ns.with.dots"])
def test_namespaces_must_be_dns_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], namespace: str
) -> None:
    spec = "spec: {model: {name: t, source: {builtin: sovereign-tiny}}}\n"
    head = "apiVersion: sovereign.ai/v1alpha1\nkind: LLMDeployment\n"
    path = _write(tmp_path, head + f"metadata: {{name: t, namespace: {json.dumps(namespace)}}}\n" + spec)
    assert main(["render", "-f", path]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metadata.namespace: must be a namespace name" in err[0]
    path = _write(tmp_path, head + "metadata: {name: t}\n" + spec)
    assert main(["render", "-f", path, "--namespace", namespace]) == 2
    assert "--namespace: must be a namespace name" in capsys.readouterr().err
