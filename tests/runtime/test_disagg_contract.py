"""Contract between the operator's renderer and the runtime: the prefill, decode and router processes
are started with exactly the command, arguments and environment that `sovereign-operator render`
produces for `examples/tiny.yaml` in disaggregated mode, with only addresses mapped to 127.0.0.1 and
ports to free ones (no cluster DNS here: the router gets static `--prefill/--decode` URLs instead of
its EndpointSlice Services). They are probed on the StatefulSets' probe paths and the built-in model
answers held-out questions correctly through the router, with the KV crossing from prefill to decode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from disagg_support import Instance
from server_support import distinct_free_ports
from sovereign_runtime.builtin import resolve_builtin
from sovereign_runtime.builtin.tasks import check_answer, make_questions

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
QUESTIONS = 16


def _render_disaggregated(tmp_path: Path) -> dict[str, dict[str, Any]]:
    spec = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    spec["spec"]["mode"] = "disaggregated"
    spec["spec"]["prefill"] = {"replicas": 1}
    spec["spec"]["decode"]["replicas"] = 2
    spec["spec"]["router"] = {"disaggregationThresholdChars": 0}  # short questions are paired too
    path = tmp_path / "tiny-pd.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = subprocess.run(
        [str(BIN / "sovereign-operator"), "render", "-f", str(path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(out) if d}


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def _env(container: dict[str, Any], pod: str) -> dict[str, str]:
    """The rendered env, with the downward-API fields a kubelet would fill in for a pod on 127.0.0.1."""
    fields = {"status.podIP": "127.0.0.1", "metadata.name": pod, "metadata.namespace": "default"}
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1")  # added: a shared 2-core machine, not part of the contract
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _localize(args: list[str], port: int) -> list[str]:
    """`--host 0.0.0.0` -> 127.0.0.1 and `--port 8000` -> a free port; everything else verbatim."""
    out = list(args)
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(port)
    return out


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


def _wait(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _get(url) != 200:
        if proc.poll() is not None:
            log = Path(getattr(proc, "log_path", "")).read_text(errors="replace")[-2000:]
            raise AssertionError(f"{proc.args} exited with {proc.returncode} before {url} answered:\n{log}")
        assert time.monotonic() < deadline, f"{url} not 200 within {timeout_s:g} s"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    objs = _render_disaggregated(tmp_path_factory.mktemp("contract"))
    procs: list[subprocess.Popen[bytes]] = []
    logs = tmp_path_factory.mktemp("logs")

    def start(
        container: dict[str, Any], args: list[str], env: dict[str, str], name: str
    ) -> subprocess.Popen[bytes]:
        command = [str(BIN / container["command"][0]), *container["command"][1:], *args]
        log = (logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        proc.log_path = str(logs / f"{name}.log")  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    ports = iter(distinct_free_ports(6))
    try:
        workers: dict[str, list[str]] = {"prefill": [], "decode": []}
        probes: list[tuple[str, subprocess.Popen[bytes]]] = []
        for role, count in (("prefill", 1), ("decode", 2)):
            sts = objs[f"StatefulSet/tiny-{role}"]
            c = _container(sts)
            for i in range(count):
                port = next(ports)
                # Two decode pods share this host: each gets its own KV port (8001 in the pod).
                extra = ["--kv-port", str(next(ports))] if role == "decode" else []
                proc = start(
                    c, _localize(c["args"], port) + extra, _env(c, f"tiny-{role}-{i}"), f"{role}-{i}"
                )
                url = f"http://127.0.0.1:{port}"
                workers[role].append(url)
                probes += [
                    (url + c[p]["httpGet"]["path"], proc)
                    for p in ("startupProbe", "livenessProbe", "readinessProbe")
                ]
        for url, proc in probes:
            _wait(url, proc)
        router = _container(objs["Deployment/tiny-router"])
        args = list(router["args"])
        for flag in ("--namespace", "--prefill-service", "--decode-service"):  # cluster discovery -> static
            i = args.index(flag)
            del args[i : i + 2]
        rport = next(ports)
        args = [*_localize(args, rport), "--prefill", *workers["prefill"], "--decode", *workers["decode"]]
        rproc = start(router, args, _env(router, "tiny-router"), "router")
        rurl = f"http://127.0.0.1:{rport}"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in router:
                _wait(rurl + router[probe]["httpGet"]["path"], rproc, 60)
        yield {"router": rurl, **workers, "logs": logs}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _answer(base: str, prompt: str) -> str:
    body = {
        "model": "sovereign-tiny",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 64,
    }
    return _post(base + "/v1/chat/completions", body)["choices"][0]["message"]["content"] or ""


def _kv(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/health/kv", timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_rendered_processes_answer_through_the_router_with_kv_from_prefill(
    deployment: dict[str, Any],
) -> None:
    questions = make_questions(QUESTIONS, seed=606)

    def ask(prompt: str) -> str:
        return _answer(deployment["router"], prompt)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda q: ask(q.prompt), questions))
    # Greedy: exactly what a unified instance of the same model answers (it is right on most questions).
    unified = Instance(resolve_builtin("builtin:sovereign-tiny"), "unified", name="sovereign-tiny")
    try:
        expected = [_answer(unified.url, q.prompt) for q in questions]
    finally:
        unified.close()
    assert answers == expected
    correct = sum(check_answer(q, a) for q, a in zip(questions, answers, strict=True))
    assert correct >= 0.75 * QUESTIONS, f"{correct}/{QUESTIONS}: {answers}"
    decodes = [_kv(u) for u in deployment["decode"]]
    prefill = _kv(deployment["prefill"][0])
    assert all(d["role"] == "decode" and d["transport"] == "tcp" and d["healthy"] for d in decodes)
    assert sum(d["transfers_ok"] for d in decodes) == QUESTIONS and sum(d["fallbacks"] for d in decodes) == 0
    assert prefill["transfers_ok"] == QUESTIONS and prefill["tokens"] == sum(d["tokens"] for d in decodes)
    # The decode advertises the pod IP from the rendered POD_IP env (mapped to 127.0.0.1 here).
    assert all(d["address"].startswith("127.0.0.1:") for d in decodes)
