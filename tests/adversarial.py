"""The adversarial suite: a hostile or careless client against the runtime, the router and `render`.

    OMP_NUM_THREADS=1 .venv/bin/python tests/adversarial.py [--budget-s 600] [--json OUT.json]

Loopback only and bounded: two unified workers of the built-in model and a router, all on 127.0.0.1,
every request with a deadline (a request past it is a hang), the whole run within --budget-s. For each
attack it reports the inputs tried, the answers by class (4xx, 5xx, hangs, 2xx where a rejection was
expected: silently accepted), and how many innocent requests failed: greedy questions sent through
the router at the same time, each compared with the answer it got alone before any attack. Prints
one markdown table (docs/BENCHMARKS.md carries the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "builtin:sovereign-tiny"
REQUEST_DEADLINE_S = 20.0


@dataclass
class Tally:
    attack: str
    inputs: int = 0
    ok: int = 0
    client_errors: int = 0
    server_errors: int = 0
    hangs: int = 0
    accepted_but_should_reject: int = 0
    innocent_sent: int = 0
    innocent_failed: int = 0
    notes: list[str] = field(default_factory=list)

    def record(self, status: int | None, expect_reject: bool, label: str) -> None:
        self.inputs += 1
        if status is None:
            self.hangs += 1
            self.notes.append(f"{label}: no answer in {REQUEST_DEADLINE_S:.0f} s")
        elif status >= 500:
            self.server_errors += 1
            self.notes.append(f"{label}: {status}")
        elif status >= 400:
            self.client_errors += 1
        else:
            self.ok += 1
            if expect_reject:
                self.accepted_but_should_reject += 1
                self.notes.append(f"{label}: {status} (accepted)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def processes(commands: list[list[str]], log_dir: Path):  # type: ignore[no-untyped-def]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for i, cmd in enumerate(commands):
            log = (log_dir / f"proc{i}.log").open("w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def wait_ready(session: aiohttp.ClientSession, url: str, deadline_s: float = 180) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url + "/health/ready", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.5)
    raise SystemExit(f"adversarial: {url} did not become ready in {deadline_s:.0f} s")


async def wait_routable(
    session: aiohttp.ClientSession, router: str, count: int, deadline_s: float = 60
) -> None:
    """Until the router routes to every worker (its health checks run every 5 s)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        async with session.get(router + "/health") as resp:
            if (await resp.json())["routable"] == count:
                return
        await asyncio.sleep(0.5)
    raise SystemExit(f"adversarial: the router did not route to {count} workers in {deadline_s:.0f} s")


async def send(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> int | None:
    """The status, or None when no answer came within the deadline."""
    try:
        async with session.request(
            method,
            url,
            data=body,
            headers=headers or {"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=REQUEST_DEADLINE_S),
        ) as resp:
            await resp.read()
            return resp.status
    except TimeoutError:
        return None
    except aiohttp.ClientError:
        return 599  # the connection dropped: counted as a server error


async def send_raw(host: str, port: int, payload: bytes) -> int | None:
    """A raw HTTP/1.1 exchange, for what aiohttp's client refuses to send (undecodable headers)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        writer.write(payload)
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), REQUEST_DEADLINE_S)
        writer.close()
        return int(head.split()[1]) if head.startswith(b"HTTP/") else 599
    except TimeoutError:
        return None
    except (OSError, ValueError, IndexError):
        return 599


# ---- innocent traffic -------------------------------------------------------------------------------


class Innocents:
    """Greedy questions through the router while an attack runs. Each must get exactly the answer the
    same question got alone before any attack (``calibrate``): the built-in model gets a few sums
    wrong, and that is not an attack's doing; a different answer, or any non-200, is."""

    POOL = 64

    def __init__(self, session: aiohttp.ClientSession, router: str, concurrency: int = 4) -> None:
        import random

        from sovereign_runtime.builtin.tasks import sample_training_question

        self.session, self.router, self.concurrency = session, router, concurrency
        rng = random.Random(0)
        self.questions = [sample_training_question(rng).messages() for _ in range(self.POOL)]
        self.reference: list[str] = []
        self.sent = self.failed = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()

    async def _ask(self, messages: list[dict[str, str]]) -> tuple[int, Any, str | None]:
        body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 64}
        async with self.session.post(
            self.router + "/v1/chat/completions",
            json=body,
            timeout=aiohttp.ClientTimeout(total=REQUEST_DEADLINE_S * 3),
        ) as resp:
            answer = await resp.json(content_type=None)
            content = answer["choices"][0]["message"]["content"] if resp.status == 200 else None
            return resp.status, answer, content

    async def calibrate(self) -> None:
        """Each question's answer, asked one at a time with nothing else running."""
        for messages in self.questions:
            status, answer, content = await self._ask(messages)
            if status != 200 or content is None:
                raise SystemExit(f"adversarial: calibration failed: {status} {answer}")
            self.reference.append(content)

    async def _one(self, rng: Any) -> None:
        index = rng.randrange(len(self.questions))
        self.sent += 1
        try:
            status, answer, content = await self._ask(self.questions[index])
            if status != 200 or content != self.reference[index]:
                self.failed += 1
                said = content if status == 200 else answer
                asked = self.questions[index][-1]["content"]
                self.failures.append(
                    f"{status}: asked {asked!r}, got {str(said)[:160]!r}, alone {self.reference[index]!r}"
                )
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            self.failed += 1
            self.failures.append(f"{exc.__class__.__name__}: {exc}"[:160])

    async def _loop(self, seed: int) -> None:
        import random

        rng = random.Random(seed)
        while not self._stop.is_set():
            await self._one(rng)

    @contextlib.asynccontextmanager
    async def running(self, tally: Tally) -> AsyncIterator[None]:
        self._stop.clear()
        sent, failed = self.sent, self.failed
        tasks = [asyncio.create_task(self._loop(seed)) for seed in range(self.concurrency)]
        try:
            yield
        finally:
            self._stop.set()
            await asyncio.gather(*tasks)
            tally.innocent_sent += self.sent - sent
            tally.innocent_failed += self.failed - failed
            tally.notes += [f"innocent failed: {f}" for f in self.failures[failed : failed + 3]]


# ---- attacks ------------------------------------------------------------------------------------------


def malformed_inputs() -> list[tuple[str, bytes, bool]]:
    """(label, body, whether a rejection is the right answer) for POST /v1/chat/completions."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "What is 1 + 2?"}], "max_tokens": 8}

    def with_(**changes: Any) -> bytes:
        return json.dumps({**chat, **changes}).encode()

    tool_history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    return [
        ("not JSON", b"{not json", True),
        ("100k-deep nesting", b"[" * 100_000, True),
        ("non-UTF-8 body", b'{"messages": "\xff\xfe"}', True),
        ("5000-digit integer", b'{"max_tokens": ' + b"9" * 5000 + b"}", True),
        ("top-level array", b"[1, 2]", True),
        ("lone surrogate", with_(messages=[{"role": "user", "content": "\ud800"}]), True),
        ("tool-call history", with_(messages=tool_history), False),
        ("tools", with_(tools=[{"type": "function", "function": {"name": "w", "parameters": {}}}]), True),
        ("response_format json_object", with_(response_format={"type": "json_object"}), False),
        ("logit_bias", with_(logit_bias={"15": -100}), False),
        ("logit_bias token id past the vocabulary", with_(logit_bias={"999999999": 5}), True),
        ("logit_bias value 1e9", with_(logit_bias={"15": 1e9}), True),
        ("logit_bias 5000 entries", with_(logit_bias={str(t): 1 for t in range(5000)}), True),
        ("top_k overflow", with_(top_k=9223372036854775808, top_p=0.5), True),
        ("temperature -1", with_(temperature=-1), True),
        ("top_p 2", with_(top_p=2), True),
        ("max_tokens -1", with_(max_tokens=-1), True),
        ("max_tokens 1e12", with_(max_tokens=10**12), True),
        ("max_tokens as string", with_(max_tokens="8"), True),
        ("n 1000", with_(n=1000), True),
        ("seed 2^70", with_(seed=2**70), True),
        ("top_logprobs 1000", with_(logprobs=True, top_logprobs=1000), True),
        ("messages not a list", with_(messages="hi"), True),
        ("unknown role", with_(messages=[{"role": "wizard", "content": "x"}]), True),
        ("content is a number", with_(messages=[{"role": "user", "content": 5}]), True),
        ("1000 stop strings", with_(stop=["x"] * 1000), True),
        (
            "forged kv_transfer_params",
            with_(kv_transfer_params={"prefill_url": "http://127.0.0.1:9/x?", "room": "r"}),
            False,
        ),
        ("empty messages", with_(messages=[]), True),
    ]


def completion_inputs() -> list[tuple[str, bytes, bool]]:
    base = {"model": MODEL, "max_tokens": 4}
    return [
        ("token id out of vocab", json.dumps({**base, "prompt": [999_999_999]}).encode(), True),
        ("negative token id", json.dumps({**base, "prompt": [-1]}).encode(), True),
        ("5000 prompts", json.dumps({**base, "prompt": ["1 + 1"] * 5000}).encode(), True),
        ("empty prompt", json.dumps({**base, "prompt": ""}).encode(), True),
        ("prompt of objects", json.dumps({**base, "prompt": [{"a": 1}]}).encode(), True),
    ]


async def attack_malformed(
    session: aiohttp.ClientSession, targets: dict[str, str], innocents: Innocents
) -> Tally:
    tally = Tally("malformed and out-of-range bodies, router and worker")
    async with innocents.running(tally):
        for where, base in targets.items():
            for label, body, reject in malformed_inputs():
                status = await send(session, "POST", base + "/v1/chat/completions", body)
                tally.record(status, reject, f"{where}: {label}")
            for label, body, reject in completion_inputs():
                status = await send(session, "POST", base + "/v1/completions", body)
                tally.record(status, reject, f"{where}: {label}")
            for label, method, path in (
                ("unknown path", "GET", "/v1/nope"),
                ("GET on POST", "GET", "/v1/completions"),
            ):
                tally.record(await send(session, method, base + path), True, f"{where}: {label}")
            host, port = base.removeprefix("http://").split(":")
            payload = b'{"prompt": "x", "max_tokens": 1}'
            raw = (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (len(payload), payload)
            )
            # Without an API key the header is not even read: 200 is right; with one, 401.
            tally.record(await send_raw(host, int(port), raw), False, f"{where}: non-UTF-8 Authorization")
    return tally


async def attack_disconnects(
    session: aiohttp.ClientSession, router: str, innocents: Innocents, seconds: float
) -> Tally:
    """Streams that hang up after three chunks, 8 per second (the finding: both workers taken out)."""
    tally = Tally(f"clients hanging up mid-stream, 8/s for {seconds:.0f} s")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is 12 + 30?"}],
        "max_tokens": 64,
        "stream": True,
    }

    async def hang_up() -> None:
        tally.inputs += 1
        try:
            async with session.post(
                router + "/v1/chat/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=REQUEST_DEADLINE_S),
            ) as resp:
                if resp.status >= 500:
                    tally.server_errors += 1
                for _ in range(3):
                    await resp.content.readany()
                resp.close()
                tally.ok += 1
        except TimeoutError:
            tally.hangs += 1
        except aiohttp.ClientError:
            tally.server_errors += 1

    async with innocents.running(tally):
        deadline = time.monotonic() + seconds
        pending: list[asyncio.Task[None]] = []
        while time.monotonic() < deadline:
            pending += [asyncio.create_task(hang_up()) for _ in range(8)]
            await asyncio.sleep(1.0)
        await asyncio.gather(*pending)
    return tally


async def attack_top_k(
    session: aiohttp.ClientSession, router: str, innocents: Innocents, rounds: int = 5
) -> Tally:
    """The overflowing top_k sent while innocent requests share the batch (the finding: 4 victims)."""
    tally = Tally(f"top_k overflow in a shared batch, {rounds} rounds")
    bad = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is 1 + 1?"}],
        "top_k": 9223372036854775808,
        "top_p": 0.5,
        "max_tokens": 16,
    }
    async with innocents.running(tally):
        for _ in range(rounds):
            status = await send(session, "POST", router + "/v1/chat/completions", json.dumps(bad).encode())
            tally.record(status, True, "top_k overflow")
            await asyncio.sleep(0.5)
    return tally


async def attack_big_body(
    session: aiohttp.ClientSession, worker: str, router: str, innocents: Innocents
) -> Tally:
    """A 16.8 MB prompt straight at a worker while /health must keep answering (the finding: 55.7 s)."""
    tally = Tally("16.8 MB prompt at a worker (health latency in notes)")
    prompt = "What is 1 + 1? " * 1_120_000
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    async with innocents.running(tally):
        big = asyncio.create_task(send(session, "POST", worker + "/v1/completions", body))
        worst = 0.0
        while not big.done():
            started = time.perf_counter()
            status = await send(session, "GET", worker + "/health")
            worst = max(worst, time.perf_counter() - started)
            if status is None:
                break
            await asyncio.sleep(0.2)
        tally.record(await big, True, "16.8 MB prompt")
        tally.notes.append(f"slowest /health answer while it was handled: {worst:.2f} s")
    return tally


async def attack_slowloris(targets: dict[str, str], innocents: Innocents, connections: int = 100) -> Tally:
    """Connections that send their headers, or their body, a byte every 2 s (the finding: never timed
    out). Each must be answered 408 (or closed) within the server's deadline plus a margin."""
    tally = Tally(f"slowloris: {connections} trickling connections per target (headers and bodies)")
    give_up_s = 15.0 + 60.0 + 15.0  # the longest default deadline (body) after the headers, plus margin
    closed_without_answer = 0

    async def trickle(url: str, head: bytes) -> None:
        nonlocal closed_without_answer
        host, port = url.removeprefix("http://").split(":")
        tally.inputs += 1
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
        except (OSError, TimeoutError):
            tally.server_errors += 1
            tally.notes.append(f"{url}: could not connect")
            return
        writer.write(head)
        deadline = time.monotonic() + give_up_s
        answer = b""
        try:
            while time.monotonic() < deadline:
                try:
                    answer = await asyncio.wait_for(reader.read(65536), 2.0)
                    break  # an answer, or b"" when closed
                except TimeoutError:
                    writer.write(b"a")  # one more byte of a header value, or of the body
            else:
                tally.hangs += 1
                tally.notes.append(f"{url}: still open after {give_up_s:.0f} s")
                return
        except (ConnectionError, OSError):
            answer = b""
        finally:
            writer.close()
        if answer.startswith(b"HTTP/1.1 408"):
            tally.client_errors += 1
        elif answer == b"":
            tally.client_errors += 1
            closed_without_answer += 1
        else:
            tally.server_errors += 1
            tally.notes.append(f"{url}: {answer[:40]!r}")

    heads = [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n{",
    ]
    async with innocents.running(tally):
        await asyncio.gather(
            *(trickle(url, heads[i % 2]) for url in targets.values() for i in range(connections))
        )
    if closed_without_answer:
        tally.notes.append(f"{closed_without_answer} closed without an answer")
    return tally


def attack_render() -> Tally:
    """`sovereign-operator render` on hostile YAML: one line, a non-zero exit, within the deadline."""
    tally = Tally("render: hostile YAML and invalid values")
    head = "apiVersion: sovereign.ai/v1alpha1\nkind: LLMDeployment\nmetadata: {name: t}\nspec:\n"
    model = "  model: {name: t, source: {builtin: sovereign-tiny}}\n"
    bomb = head + "  l0: &l0 [" + ", ".join(["lol"] * 9) + "]\n"
    bomb += "".join(f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 10))
    cases: list[tuple[str, bytes]] = [
        ("alias bomb", bomb.encode()),
        ("20,000 nested [", b"[" * 20_000),
        ("non-UTF-8 bytes", b"apiVersion: \xff\xfe\n"),
        (
            "maxReplicas 1e12",
            (head + model + "  decode: {autoscaling: {maxReplicas: 1000000000000}}\n").encode(),
        ),
        (
            "namespace ../../kube-system",
            (head.replace("{name: t}", '{name: t, namespace: "../../kube-system"}') + model).encode(),
        ),
        (
            "cpu -4 / memory with a shell command",
            (
                head + model + '  runtime: {resources: {requests: {cpu: -4, memory: "2Gi; rm -rf"}}}\n'
            ).encode(),
        ),
        (
            "pvc path ../../../etc",
            (
                head
                + '  model: {name: t, weightsGiB: 1, source: {pvc: {claimName: w, path: "../../../etc"}}}\n'
            ).encode(),
        ),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for label, content in cases:
            path = Path(tmp) / "hostile.yaml"
            path.write_bytes(content)
            try:
                result = subprocess.run(
                    [str(BIN / "sovereign-operator"), "render", "-f", str(path)],
                    capture_output=True,
                    text=True,
                    timeout=REQUEST_DEADLINE_S * 3,
                )
            except subprocess.TimeoutExpired:
                tally.record(None, True, label)
                continue
            lines = result.stderr.strip().splitlines()
            if result.returncode == 0:
                tally.record(200, True, label)
            elif "Traceback" in result.stderr or len(lines) != 1:
                tally.record(500, True, f"{label}: traceback or {len(lines)} lines")
            else:
                tally.record(400, True, label)
    return tally


# ---- the run ------------------------------------------------------------------------------------------


async def run(budget_s: float, log_dir: Path) -> list[Tally]:
    ports = [free_port() for _ in range(3)]
    workers = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    router = f"http://127.0.0.1:{ports[2]}"
    serve = [
        str(BIN / "sovereign-runtime"),
        "serve",
        "--model",
        MODEL,
        "--host",
        "127.0.0.1",
        "--device",
        "cpu",
        "--max-num-seqs",
        "8",
    ]
    commands = [[*serve, "--port", str(p)] for p in ports[:2]]
    commands.append(
        [
            str(BIN / "sovereign-runtime"),
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(ports[2]),
            "--worker",
            *workers,
        ]
    )
    started = time.monotonic()
    tallies = [attack_render()]
    with processes(commands, log_dir):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for url in [*workers, router]:
                await wait_ready(session, url)
            await wait_routable(session, router, len(workers))
            innocents = Innocents(session, router)
            await innocents.calibrate()
            baseline = Tally("baseline: no attack, 10 s")
            async with innocents.running(baseline):
                await asyncio.sleep(10)
            tallies.append(baseline)
            attacks: list[Callable[[], Awaitable[Tally]]] = [
                lambda: attack_malformed(session, {"router": router, "worker": workers[0]}, innocents),
                lambda: attack_top_k(session, router, innocents),
                lambda: attack_disconnects(session, router, innocents, seconds=10),
                lambda: attack_big_body(session, workers[1], router, innocents),
                lambda: attack_slowloris({"router": router, "worker": workers[0]}, innocents),
            ]
            for attack in attacks:
                if time.monotonic() - started > budget_s:
                    print("adversarial: budget spent, stopping early", file=sys.stderr)
                    break
                tallies.append(await attack())
    return tallies


def table(tallies: list[Tally]) -> str:
    rows = [
        "| attack | inputs | 2xx | 4xx | 5xx | hangs | accepted, should reject | innocent failed / sent |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in tallies:
        rows.append(
            f"| {t.attack} | {t.inputs} | {t.ok} | {t.client_errors} | {t.server_errors} | {t.hangs} |"
            f" {t.accepted_but_should_reject} | {t.innocent_failed} / {t.innocent_sent} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=600)
    parser.add_argument("--json", type=Path, help="write every tally (with notes) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="adversarial-") as tmp:
        tallies = asyncio.run(run(args.budget_s, Path(tmp)))
    print(table(tallies))
    for t in tallies:
        for note in t.notes:
            print(f"- {t.attack}: {note}")
    if args.json:
        args.json.write_text(json.dumps([t.__dict__ for t in tallies], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
