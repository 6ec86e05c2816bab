"""Running a parallel group as LeaderWorkerSet would: one ``serve`` process per "node", each started on its
own, on distinct loopback addresses (127.0.0.0/8 stands for the hosts), meeting at the leader's address."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN = "builtin:sovereign-tiny"
# One thread per process: a group is several processes on a small shared machine.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
for _name in ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"):
    ENV.pop(_name, None)
SERVE = ["--model", BUILTIN, "--device", "cpu", "--num-kv-blocks", "64", "--max-num-seqs", "4"]

_next_host = iter(range(2, 250))


def next_host() -> str:
    """A loopback address no other group of this test session uses."""
    return f"127.0.0.{next(_next_host)}"


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    host: str
    port: int
    argv: list[str]
    proc: subprocess.Popen[str] | None = None
    output: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "sovereign_runtime", "serve", *self.argv]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
        )

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        out, _ = self.proc.communicate(timeout=timeout_s)
        self.output += out
        return int(self.proc.returncode)


@dataclass
class Group:
    """``nnodes`` processes: node 0 (the leader, serving the API) and the workers."""

    nodes: list[Node]
    rendezvous_port: int
    scratch: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="sovereign-group-test-"))

    @property
    def leader(self) -> Node:
        return self.nodes[0]

    def start(self, only: Sequence[int] | None = None) -> None:
        env = {**ENV, "TMPDIR": self.scratch}
        for i, node in enumerate(self.nodes):
            if only is None or i in only:
                node.start(env)

    def stop(self) -> None:
        """Kill whatever still runs, with every rank each node started (never a stray process)."""
        for node in self.nodes:
            if node.proc is None:
                continue
            children = descendants(node.proc.pid)
            if node.proc.poll() is None:
                node.proc.kill()
            with contextlib.suppress(Exception):
                node.wait(30)
            for pid in children:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.scratch, ignore_errors=True)


def make_group(tp: int, pp: int, nnodes: int, *flags: str, kv_port: bool = False) -> Group:
    hosts = [next_host() for _ in range(nnodes)]
    rendezvous = free_port(hosts[0])
    nodes = []
    for rank, host in enumerate(hosts):
        argv = [
            *SERVE, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--nnodes", str(nnodes), "--node-rank", str(rank), "--leader-address", f"{hosts[0]}:{rendezvous}",
            "--host", host, "--port", str(free_port(host)), "--rank-timeout", "5", *flags,
        ]  # fmt: skip
        if kv_port:
            argv += ["--kv-port", str(free_port(host))]
        nodes.append(Node(host, int(argv[argv.index("--port") + 1]), argv))
    return Group(nodes, rendezvous)


@contextlib.contextmanager
def running(group: Group, only: Sequence[int] | None = None) -> Iterator[Group]:
    group.start(only)
    try:
        yield group
    finally:
        group.stop()


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Field 4 (after the parenthesised command, which may hold spaces) is the parent pid.
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
                frontier.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def get(url: str, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def wait_ready(node: Node, timeout_s: float = 300) -> None:
    """Until the node answers ready (a group of several processes starts slowly on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert node.proc is not None
        if node.proc.poll() is not None:
            node.wait(5)
            raise AssertionError(f"{node.url} exited with {node.proc.returncode}:\n{node.output[-4000:]}")
        if time.monotonic() >= deadline:
            with contextlib.suppress(OSError, ValueError):
                raise AssertionError(f"{node.url} never became ready: {get(node.url + '/health/startup')[1]}")
            raise AssertionError(f"{node.url} never became ready")
        with contextlib.suppress(OSError, ValueError):
            if get(node.url + "/health/ready")[0] == 200:
                return
        time.sleep(0.2)


def post(url: str, body: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


def chat(base: str, prompt: str, **extra: object) -> str:
    body = {"model": BUILTIN, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
    answer = post(base + "/v1/chat/completions", {"max_tokens": 64, **body, **extra})
    return str(answer["choices"][0]["message"]["content"])
