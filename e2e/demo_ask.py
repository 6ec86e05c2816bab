"""Run one pool's container command on this machine and ask the built-in model a few questions.

kwok's pods run no containers, so `make demo` starts the process the tiny pool's pods would run, with
the exact arguments the operator rendered into the StatefulSet (only the listen address changes), and
sends OpenAI chat completions to it. The cluster suite (tests/cluster/test_tiny_serves.py) uses the
same functions, against this local process on the local control plane and through the router's
Service on a cluster whose pods really run (kind).

    python e2e/demo_ask.py '<the container args as JSON>'

Where the tiny example runs on the local cluster's real node, `make demo` asks its endpoint instead
(the router Service, port-forwarded to 127.0.0.1):

    python e2e/demo_ask.py --endpoint http://127.0.0.1:PORT MODEL
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sovereign_runtime.builtin.tasks import check_answer, make_questions

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Answer:
    prompt: str
    reasoning: str | None
    content: str
    correct: bool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_args(rendered: list[str], port: int) -> list[str]:
    """The rendered arguments, listening on 127.0.0.1:`port` instead of the pod's 0.0.0.0:8000."""
    args = list(rendered)
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def served_model_name(rendered: list[str]) -> str | None:
    return rendered[rendered.index("--served-model-name") + 1] if "--served-model-name" in rendered else None


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def wait_ready(base: str, process: subprocess.Popen | None = None, timeout_s: float = 300) -> None:
    """Poll `base`/health/ready; fail early if the local `process` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the runtime exited with {process.returncode}")
        try:
            with urllib.request.urlopen(base + "/health/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{base} was not ready after {timeout_s:g} s")


@contextmanager
def serve_locally(rendered: list[str], log: Path | None = None) -> Iterator[str]:
    """Run `sovereign-runtime <rendered args>` here; yield its base URL once it is ready."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = log.open("ab") if log else subprocess.DEVNULL
    process = subprocess.Popen(
        [str(BIN / "sovereign-runtime"), *local_args(rendered, port)], env=env, stdout=out, stderr=out
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=60)
        if log:
            out.close()  # type: ignore[union-attr]


def ask(base: str, model: str | None, count: int = 3, seed: int = 2026) -> list[Answer]:
    """Ask `count` checkable questions through OpenAI chat completions (greedy)."""
    answers = []
    for question in make_questions(count, seed=seed):
        reply = post(
            base + "/v1/chat/completions",
            {"model": model, "messages": question.messages(), "temperature": 0, "max_tokens": 64},
        )
        message = reply["choices"][0]["message"]
        content = message["content"] or ""
        answers.append(
            Answer(
                question.prompt, message.get("reasoning_content"), content, check_answer(question, content)
            )
        )
    return answers


def print_answers(answers: list[Answer]) -> None:
    for answer in answers:
        verdict = "correct" if answer.correct else "WRONG"
        print(f"  Q: {answer.prompt}")
        print(f"     reasoning: {answer.reasoning!r}")
        print(f"     answer:    {answer.content!r} ({verdict})")


def main() -> None:
    if sys.argv[1:2] == ["--endpoint"]:
        base, model = sys.argv[2], sys.argv[3]
        try:
            wait_ready(base, timeout_s=120)
            print_answers(ask(base, model))
        except (RuntimeError, OSError) as err:
            raise SystemExit(f"demo: {base}: {err}") from None
        return
    rendered = json.loads(sys.argv[1])
    print("demo: sovereign-runtime " + " ".join(rendered) + "  (here: on 127.0.0.1)", flush=True)
    try:
        with serve_locally(rendered) as base:
            print_answers(ask(base, served_model_name(rendered)))
    except RuntimeError as err:
        raise SystemExit(f"demo: {err}") from None


if __name__ == "__main__":
    main()
