"""Run one pool's container command on this machine and ask the built-in model a few questions.

kwok's pods run no containers, so `make demo` starts the process the tiny pool's pods would run, with
the exact arguments the operator rendered into the StatefulSet (only the listen address changes), and
sends OpenAI chat completions to it.

    python e2e/demo_ask.py '<the container args as JSON>'
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
from pathlib import Path

from sovereign_runtime.builtin.tasks import check_answer, make_questions

BIN = Path(sys.executable).parent


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


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def wait_ready(base: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"demo: the runtime exited with {process.returncode}")
        try:
            with urllib.request.urlopen(base + "/health/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise SystemExit(f"demo: the runtime was not ready after {timeout_s:g} s")


def main() -> None:
    rendered = json.loads(sys.argv[1])
    port = free_port()
    args = local_args(rendered, port)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print("demo: sovereign-runtime " + " ".join(args), flush=True)
    process = subprocess.Popen(
        [str(BIN / "sovereign-runtime"), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process)
        model = (
            rendered[rendered.index("--served-model-name") + 1] if "--served-model-name" in rendered else None
        )
        for question in make_questions(3, seed=2026):
            answer = post(
                base + "/v1/chat/completions",
                {"model": model, "messages": question.messages(), "temperature": 0, "max_tokens": 64},
            )
            message = answer["choices"][0]["message"]
            verdict = "correct" if check_answer(question, message["content"] or "") else "WRONG"
            print(f"  Q: {question.prompt}")
            print(f"     reasoning: {message.get('reasoning_content')!r}")
            print(f"     answer:    {message['content']!r} ({verdict})")
    finally:
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
