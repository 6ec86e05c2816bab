"""A pod whose output goes bad leaves the router's rotation; the other serves every request.

Two unified workers and the router are started with the command `sovereign-operator render` produces
for `examples/tiny.yaml` (two replicas), addresses mapped to 127.0.0.1 and free ports, as
test_disagg_contract.py does. Worker 1 also gets test-only fault injection: NaN in every sequence's layer
output once a few seconds have passed (it starts healthy, passes its startup self-test and serves), and a
short self-test interval. Its periodic self-test catches the fault, `/health/ready` turns 503 naming the
failing check, the router stops routing to it, and requests through the router all succeed on worker 0.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from server_support import distinct_free_ports
from sovereign_runtime.builtin.tasks import check_answer, make_questions

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ONSET_S = 20.0  # after the startup self-test even on a loaded machine


def _render(tmp_path: Path) -> dict[str, dict[str, Any]]:
    spec = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    spec["spec"]["decode"]["replicas"] = 2
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = subprocess.run(
        [str(BIN / "sovereign-operator"), "render", "-f", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(out) if d}


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def _env(container: dict[str, Any], pod: str) -> dict[str, str]:
    fields = {"status.podIP": "127.0.0.1", "metadata.name": pod, "metadata.namespace": "default"}
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1")
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _localize(args: list[str], port: int) -> list[str]:
    out = list(args)
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(port)
    return out


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            raw = resp.read()
            status = int(resp.status)
    except urllib.error.HTTPError as err:
        raw, status = err.read(), int(err.code)
    except OSError:
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _wait_for(what: str, predicate: Any, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                log = Path(getattr(p, "log_path", "")).read_text(errors="replace")[-2000:]
                raise AssertionError(f"{p.args} exited with {p.returncode} while waiting for {what}:\n{log}")
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:g} s"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    objs = _render(tmp_path_factory.mktemp("guard"))
    logs = tmp_path_factory.mktemp("logs")
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        container: dict[str, Any], args: list[str], env: dict[str, str], name: str
    ) -> subprocess.Popen[bytes]:
        command = [str(BIN / container["command"][0]), *container["command"][1:], *args]
        log = (logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        proc.log_path = str(logs / f"{name}.log")  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    ports = iter(distinct_free_ports(3))
    try:
        worker = _container(objs["StatefulSet/tiny-unified"])
        urls = []
        for i in range(2):
            port = next(ports)
            args = _localize(worker["args"], port)
            if i == 1:  # added for the test: a fault that engages after ONSET_S, found by the self-test
                args += [
                    "--self-test-interval",
                    "1",
                    "--enable-fault-injection",
                    "--inject-fault",
                    f"nan_layer=1,nan_p=1,onset_s={ONSET_S}",
                ]
            start(worker, args, _env(worker, f"tiny-unified-{i}"), f"worker-{i}")
            urls.append(f"http://127.0.0.1:{port}")
        path = worker["readinessProbe"]["httpGet"]["path"]
        _wait_for("both workers ready", lambda: all(_get(u + path)[0] == 200 for u in urls), procs, 240)
        faulty_at_start = _get(urls[1] + "/health/startup")[1]
        router = _container(objs["Deployment/tiny-router"])
        args = list(router["args"])
        for flag in ("--namespace", "--worker-service"):  # cluster discovery -> static workers
            i = args.index(flag)
            del args[i : i + 2]
        rport = next(ports)
        args = [*_localize(args, rport), "--health-interval", "0.5", "--worker", *urls]
        start(router, args, _env(router, "tiny-router"), "router")
        rurl = f"http://127.0.0.1:{rport}"
        _wait_for("router ready", lambda: _get(rurl + "/health/ready")[0] == 200, procs, 60)
        yield {"router": rurl, "workers": urls, "procs": procs, "faulty_at_start": faulty_at_start}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _ask(base: str, prompt: str) -> tuple[int, dict[str, Any]]:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 64}
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), json.loads(err.read())


def _successes(url: str) -> float:
    _, text = _get(url + "/metrics")
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def test_a_pod_whose_self_test_fails_leaves_the_rotation_and_the_other_serves(
    deployment: dict[str, Any],
) -> None:
    healthy, faulty = deployment["workers"]
    procs = deployment["procs"]
    # Before the onset the faulty worker is a normal, ready worker.
    assert deployment["faulty_at_start"]["self_test"]["passed"] is True
    # Once the fault engages, its periodic self-test fails and readiness names the check.
    _wait_for(
        "the faulty worker's self-test to fail", lambda: _get(faulty + "/health/ready")[0] == 503, procs, 60
    )
    code, ready = _get(faulty + "/health/ready")
    assert code == 503
    # NaN in every step trips whichever check runs first: the batch comparison or the known answers.
    assert ready["status"] == "output_unhealthy"
    assert ready["failing_check"] in ("batch_invariance", "known_answers"), ready
    startup = _get(faulty + "/health/startup")[1]
    assert startup["self_test"]["passed"] is False and startup["self_test"]["reason"], startup
    _, metrics = _get(faulty + "/metrics")
    assert re.search(r"^sovereign:self_test_passing\{[^}]*\} 0\.0$", metrics, re.M)
    assert re.search(r"^sovereign:nonfinite_logits_total\{[^}]*\} [1-9]", metrics, re.M)
    # The router sees it: one routable worker left.
    _wait_for(
        "the router to drop the faulty worker",
        lambda: _get(deployment["router"] + "/health")[1]["routable"] == 1,
        procs,
        30,
    )
    # A request sent to the faulty pod directly is refused, never answered from NaN.
    code, body = _ask(faulty, "What is 1 + 2?")
    assert code == 503 and "self-test" in body["error"]["message"]
    before = (_successes(healthy), _successes(faulty))
    questions = make_questions(12, seed=314)
    answers = [_ask(deployment["router"], q.prompt) for q in questions]
    assert [code for code, _ in answers] == [200] * len(questions)
    correct = sum(
        check_answer(q, a["choices"][0]["message"]["content"] or "")
        for q, (_, a) in zip(questions, answers, strict=True)
    )
    assert correct >= 9
    after = (_successes(healthy), _successes(faulty))
    assert after[0] - before[0] == len(questions) and after[1] == before[1]
