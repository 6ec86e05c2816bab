"""A scale-down drops no request, proven with real processes (kwok pods never run their preStop hooks).

Two `serve` workers started with the args `sovereign-operator render -f examples/tiny.yaml` gives the
unified StatefulSet (host and port localized) sit behind a real least-load router. While streams are
in flight on both, one worker is stopped exactly as the kubelet stops a pod: the rendered
`lifecycle.preStop.exec.command` runs to completion, then SIGTERM, all within the rendered
`terminationGracePeriodSeconds`. New requests keep arriving during the drain. Every request must
finish with a full answer, those arriving after the drain began must be served by the survivor, and
the drained worker must exit 0 inside the grace period.

The rendered hook hard-codes the pod-local address `http://127.0.0.1:8000` (RUNTIME_PORT); the test's
workers listen on free ports, so that one literal is replaced by the worker's URL and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from server_support import distinct_free_ports
from sovereign_runtime.builtin.tasks import Question, check_answer, make_questions

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
POD_BASE = "http://127.0.0.1:8000"  # what the rendered preStop script talks to inside the pod
# In-flight work at the moment of the drain: long streams (ignore_eos) keep the drained worker busy
# for seconds, and a small batch (--max-num-seqs, a test-only flag) makes some of them wait in queue.
LONG_STREAMS = 6
LONG_TOKENS = 200
INFLIGHT_QUESTIONS = 6
MAX_NEW_REQUESTS = 40  # bound on the requests sent while the drain runs


def _render_unified(tmp_path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [str(BIN / "sovereign-operator"), "render", "-f", str(ROOT / "examples" / "tiny.yaml")],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    ).stdout
    (sts,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "StatefulSet"]
    return sts  # type: ignore[no-any-return]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), ""
    except OSError:
        return 0, ""


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _get(url)[0] != 200:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        assert time.monotonic() < deadline, f"{url} not ready within {timeout_s:g} s"
        time.sleep(0.2)


def _samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    status, text = _get(url + "/metrics")
    assert status == 200, url
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def _router_counts(router: str) -> tuple[dict[str, float], dict[str, float]]:
    """(answered requests by worker and code "worker code", in-flight by worker) from the router."""
    done = {
        f"{dict(k)['worker']} {dict(k)['code']}": v
        for k, v in _samples(router, "sovereign_router_requests_total").items()
    }
    busy = {dict(k)["worker"]: v for k, v in _samples(router, "sovereign_router_in_flight").items()}
    return done, busy


@dataclass
class Stream:
    """One streaming chat completion through the router, read to the end."""

    body: dict[str, Any]
    status: int = 0
    first_chunk: threading.Event = field(default_factory=threading.Event)
    reasoning: str = ""
    content: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False
    errors: list[Any] = field(default_factory=list)

    def run(self, router: str) -> Stream:
        request = urllib.request.Request(
            router + "/v1/chat/completions",
            data=json.dumps(self.body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                self.status = int(resp.status)
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    self.first_chunk.set()
                    payload = line[len("data: ") :]
                    if payload == "[DONE]":
                        self.done = True
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        self.errors.append(event["error"])
                    if event.get("usage"):
                        self.usage = event["usage"]
                    for choice in event.get("choices", []):
                        delta = choice.get("delta", {})
                        self.reasoning += delta.get("reasoning_content") or ""
                        self.content += delta.get("content") or ""
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except urllib.error.HTTPError as err:
            self.status = int(err.code)
            self.errors.append(err.read().decode(errors="replace"))
        except OSError as err:
            self.errors.append(repr(err))
        finally:
            self.first_chunk.set()
        return self


def _question_body(q: Question) -> dict[str, Any]:
    return {
        "model": "sovereign-tiny",
        "messages": q.messages(),
        "temperature": 0,
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _long_body(q: Question) -> dict[str, Any]:
    return {**_question_body(q), "max_tokens": LONG_TOKENS, "ignore_eos": True}


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    sts = _render_unified(tmp_path)
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"  # a shared 2-core machine
    procs: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], name: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        procs.append(proc)
        return proc, log

    try:
        *worker_ports, router_port = distinct_free_ports(3)
        workers: list[tuple[str, subprocess.Popen[bytes]]] = []
        started = []
        for i, port in enumerate(worker_ports):
            args = list(container["args"])
            args[args.index("--host") + 1] = "127.0.0.1"
            args[args.index("--port") + 1] = str(port)
            command = [str(BIN / container["command"][0]), *container["command"][1:], *args]
            proc, log = start([*command, "--max-num-seqs", "2"], f"worker-{i}")
            started.append((f"http://127.0.0.1:{port}", proc, log))
        logs: dict[str, Path] = {}
        for url, proc, log in started:
            _wait_ready(url + container["readinessProbe"]["httpGet"]["path"], proc, log)
            workers.append((url, proc))
            logs[url] = log
        router = f"http://127.0.0.1:{router_port}"
        rproc, rlog = start(
            [
                sys.executable,
                "-m",
                "sovereign_runtime",
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                str(router_port),
                "--worker",
                *(u for u, _ in workers),
                "--policy",
                "least-load",
                "--health-interval",
                "0.5",
            ],
            "router",
        )
        _wait_ready(router + "/health/ready", rproc, rlog, 30)
        yield {
            "router": router,
            "workers": workers,
            "pre_stop": container["lifecycle"]["preStop"]["exec"]["command"],
            "grace_s": float(pod["terminationGracePeriodSeconds"]),
            "env": env,
            "logs": logs,
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(10)


def test_scale_down_runs_the_rendered_prestop_and_drops_no_request(cluster: dict[str, Any]) -> None:
    router: str = cluster["router"]
    questions = make_questions(INFLIGHT_QUESTIONS + MAX_NEW_REQUESTS + LONG_STREAMS, seed=505)
    # Warm-up requests count too: the survivor's own counter is compared as a difference.
    served0 = {u: sum(_samples(u, "vllm:request_success_total").values()) for u, _ in cluster["workers"]}
    pool = ThreadPoolExecutor(LONG_STREAMS + INFLIGHT_QUESTIONS + 2)
    try:
        # In flight before the drain: long streams and questions spread by least-load over both workers.
        before = [Stream(_long_body(q)) for q in questions[:LONG_STREAMS]]
        before += [
            Stream(_question_body(q)) for q in questions[LONG_STREAMS : LONG_STREAMS + INFLIGHT_QUESTIONS]
        ]
        futures = [pool.submit(s.run, router) for s in before]
        for s in before:
            assert s.first_chunk.wait(30), "a request was never admitted"
        done0, busy0 = _router_counts(router)
        # Drain the busier worker (the one a StatefulSet removes is arbitrary here: both are ordinals).
        (url, proc), (survivor, _) = sorted(cluster["workers"], key=lambda w: -busy0.get(w[0], 0))
        assert busy0.get(url, 0) >= 2, f"expected work in flight on {url}: {busy0}"

        # The kubelet: preStop to completion, then SIGTERM, all within terminationGracePeriodSeconds.
        command = list(cluster["pre_stop"])
        assert command[0] == "python3" and command[1] == "-c" and command[2].count(POD_BASE) == 1
        command = [sys.executable, "-c", command[2].replace(POD_BASE, url), *command[3:]]
        grace = cluster["grace_s"]
        t0 = time.monotonic()
        hook = subprocess.Popen(command, env=cluster["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            while _get(url + "/health/ready")[0] == 200:  # the hook's POST /drain has landed
                assert time.monotonic() - t0 < 10 and hook.poll() is None, "drain did not start"
                time.sleep(0.02)

            # New requests keep arriving while the worker drains, two at a time, until it is gone.
            after: list[Stream] = []
            pending = iter(questions[LONG_STREAMS + INFLIGHT_QUESTIONS :])
            while len(after) < MAX_NEW_REQUESTS and (proc.poll() is None or len(after) < 8):
                batch = [Stream(_question_body(q)) for q, _ in zip(pending, range(2), strict=False)]
                list(pool.map(lambda s: s.run(router), batch))
                after += batch

            hook_out = hook.communicate(timeout=max(1.0, grace - (time.monotonic() - t0)))[0]
        finally:
            if hook.poll() is None:
                hook.kill()
                hook.wait(5)
        assert hook.returncode == 0, hook_out
        proc.send_signal(signal.SIGTERM)  # a no-op when the drain already ended the process
        rc = proc.wait(timeout=max(1.0, grace - (time.monotonic() - t0)))
        stopped_s = time.monotonic() - t0
        for f in futures:
            f.result(timeout=60)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

    assert rc == 0 and stopped_s < grace, (rc, stopped_s, grace)
    # What `kubectl logs` shows of it: the hook's drain with the work in flight, and its end.
    log = cluster["logs"][url].read_text()
    assert f"drain started (POST /drain): {int(busy0[url])} request(s) in flight" in log, log[-2000:]
    assert "drain finished in " in log and f"all {int(busy0[url])} in-flight request(s) completed" in log
    # Every request finished completely: 200, [DONE], a finish reason, full usage, no error event.
    for s in before + after:
        assert s.status == 200 and s.done and not s.errors, (s.status, s.errors)
        assert s.finish_reason is not None and s.usage is not None
    for s in before[:LONG_STREAMS]:
        assert s.finish_reason == "length" and s.usage["completion_tokens"] == LONG_TOKENS  # type: ignore[index]
    answered = before[LONG_STREAMS:] + after
    assert all(s.finish_reason == "stop" and s.content for s in answered)
    correct = sum(check_answer(s.body["messages"][0]["content"], s.content) for s in answered)
    assert correct >= 0.75 * len(answered), [(s.body["messages"][0]["content"], s.content) for s in answered]

    # Routing: the drained worker answered exactly what it had in flight when the drain began; every
    # request that arrived afterwards was answered by the survivor (some after a 503 retry).
    done1, _ = _router_counts(router)
    assert done1.get(f"{url} 200", 0) == done0.get(f"{url} 200", 0) + busy0[url]
    assert done1.get(f"{survivor} 200", 0) == (
        done0.get(f"{survivor} 200", 0) + busy0.get(survivor, 0) + len(after)
    )
    assert sum(done1.values()) == len(before) + len(after)  # nothing answered by "none" (503)
    served = sum(_samples(survivor, "vllm:request_success_total").values())
    assert served - served0[survivor] == done1[f"{survivor} 200"]
