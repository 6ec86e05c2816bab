"""The process group of one model replica: its layout, how its ranks meet, and how it fails as one.

A replica is ``tensor_parallel x pipeline_parallel`` ranks (processes) over ``nnodes`` nodes (pods), the
same number on each. Rank ``g`` is on node ``g // ranks_per_node``, in pipeline stage ``g // tp`` and at
tensor-parallel position ``g % tp``: with one node per stage, tensor parallelism stays within a node and
only the pipeline crosses the network. Rank 0 (the leader node's first rank) runs the engine and serves HTTP.

Meeting: every node starts on its own (one pod each, in any order) and starts its node's other ranks as
subprocesses. All ranks connect to a ``torch.distributed`` TCP store at the leader's address (rank 0
hosts it), announce themselves and wait for the whole group up to a rendezvous timeout; a rank that never
comes is named in the error every other rank exits with. Then the process group forms (NCCL between GPUs;
gloo on CPU, bound to this node's own address).

Failing as one: each rank bumps a heartbeat counter in the store; the leader watches every rank's, the
others watch the leader's. A rank silent for longer than the rank timeout, a subprocess rank that exits,
a collective that breaks, or a rank reporting its own failure (``failed`` in the store) ends every
process of the group with status 1 and a line saying which rank failed and why; nothing waits forever
for a dead peer (under NCCL a collective with one would). On the leader, requests in flight end with an
error first. The orchestrator (LeaderWorkerSet's RecreateGroupOnPodRestart) then starts the group again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("sovereign_runtime.group")

DEFAULT_PORT = 29500  # torchrun's default rendezvous port
# A worker waits in a broadcast for as long as the server is idle; the collective timeout must not end
# that wait. Dead peers are found by the heartbeats instead.
COLLECTIVE_TIMEOUT = timedelta(days=365)
_STORE_OP_TIMEOUT = timedelta(seconds=30)
_GLOO_BACKEND = "sovereign_gloo"
# Phases a rank reports in the store (``phase/<rank>``).
JOINING, LOADING, READY = "joining", "loading_weights", "ready"


class GroupError(RuntimeError):
    """The group cannot form or went away: the message names the rank(s) and why."""


@dataclass(frozen=True)
class GroupLayout:
    """How one replica's ranks are laid out over stages and nodes (pure)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def problem(self) -> str | None:
        """Why these sizes cannot be laid out, naming the flags; None if they can."""
        if self.nnodes > self.world_size or self.world_size % self.nnodes:
            return (
                f"--tensor-parallel-size {self.tensor_parallel} x --pipeline-parallel-size"
                f" {self.pipeline_parallel} = {self.world_size} rank(s) cannot be split evenly over"
                f" --nnodes {self.nnodes} (each node runs the same number of ranks)"
            )
        return None

    def stage(self, rank: int) -> int:
        return rank // self.tensor_parallel

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tensor_parallel, (stage + 1) * self.tensor_parallel))

    def peer(self, rank: int, stage: int) -> int:
        """The rank at ``rank``'s tensor-parallel position in ``stage``."""
        return stage * self.tensor_parallel + self.tp_rank(rank)


@dataclass(frozen=True)
class GroupAddress:
    """Where the group meets: the leader's host and the store's port."""

    host: str
    port: int = DEFAULT_PORT

    @classmethod
    def parse(cls, text: str) -> GroupAddress:
        """``HOST``, ``HOST:PORT`` or ``[IPv6]:PORT``; a ValueError names what is wrong."""
        text = text.strip()
        host, port = text, DEFAULT_PORT
        if text.startswith("["):
            end = text.find("]")
            if end < 0:
                raise ValueError(f"{text!r}: unclosed '[' in an IPv6 address")
            host, rest = text[1:end], text[end + 1 :]
            if rest:
                if not rest.startswith(":"):
                    raise ValueError(f"{text!r}: expected ':PORT' after the IPv6 address")
                port = _port(rest[1:], text)
        elif text.count(":") == 1:
            host, port_text = text.split(":")
            port = _port(port_text, text)
        if not host:
            raise ValueError(f"{text!r}: no host")
        return cls(host, port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _port(text: str, whole: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{whole!r}: the port must be a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{whole!r}: the port must be in [0, 65535]")
    return port


@dataclass(frozen=True)
class GroupTimeouts:
    rendezvous_s: float = 600.0  # for every rank to join (the slowest pod's start)
    rank_s: float = 30.0  # a rank silent this long is dead

    @property
    def beat_s(self) -> float:
        return max(0.05, min(1.0, self.rank_s / 6))


# ---- the process group -------------------------------------------------------------------------------


def _gloo_on(address: str) -> Callable[..., object]:
    """A gloo backend whose connections use ``address`` (this node's own), not what the hostname
    resolves to: on a pod that is its IP; in tests, distinct loopback addresses stand for hosts."""

    def create(options: object, backend_options: object = None) -> object:
        gloo = dist.ProcessGroupGloo
        opts = gloo._Options()
        opts._timeout = options.timeout  # type: ignore[attr-defined]
        opts._devices = [gloo.create_device(hostname=address)]
        group = gloo(options.store, options.group_rank, options.group_size, opts)  # type: ignore[attr-defined]
        group.options.global_ranks_in_group = options.global_ranks_in_group  # type: ignore[attr-defined]
        group.options.group_name = options.group_id  # type: ignore[attr-defined]
        return group

    return create


def node_address(host: str) -> str:
    """This node's address for the group's connections: ``host`` when it names one (``serve --host``),
    else the pod IP (downward API), else what the hostname resolves to."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _wait_for_port(address: GroupAddress, deadline: float, rank: int) -> None:
    """Wait quietly until the leader's store accepts connections (the leader's pod may start later)."""
    announced = False
    while True:
        try:
            with socket.create_connection((address.host, address.port), timeout=2.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise GroupError(
                    f"rank {rank}: the leader's rendezvous at {address} did not answer within the"
                    f" rendezvous timeout ({exc})"
                ) from None
            if not announced:
                log.info("rank %d: waiting for the leader's rendezvous at %s", rank, address)
                announced = True
            time.sleep(0.5)


def connect_store(address: GroupAddress, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store (port 0: a free one, read back from ``store.port``); others connect."""
    if rank == 0:
        return dist.TCPStore(
            address.host, address.port, world_size, True, timeout=_STORE_OP_TIMEOUT, wait_for_workers=False
        )
    _wait_for_port(address, time.monotonic() + timeout_s, rank)
    return dist.TCPStore(address.host, address.port, world_size, False, timeout=_STORE_OP_TIMEOUT)


def _json(store: dist.Store, key: str) -> dict[str, object]:
    return dict(json.loads(store.get(key).decode()))


def rendezvous(
    store: dist.Store,
    layout: GroupLayout,
    rank: int,
    address: str,
    timeout_s: float,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Announce this rank and wait until every rank has, or raise ``GroupError`` naming the missing ones."""
    store.set(
        f"joined/{rank}", json.dumps({"address": address, "pid": os.getpid(), "node": layout.node(rank)})
    )
    keys = [f"joined/{r}" for r in range(layout.world_size)]
    deadline = time.monotonic() + timeout_s
    told: list[int] | None = None
    while not store.check(keys):
        _raise_if_failed(store)
        missing = [r for r in range(layout.world_size) if not store.check([f"joined/{r}"])]
        if time.monotonic() >= deadline:
            nodes = sorted({layout.node(r) for r in missing})
            raise GroupError(
                f"rank(s) {_ranks(missing)} (node(s) {_ranks(nodes)}) of {layout.world_size} did not join"
                f" the rendezvous within {timeout_s:g} s (--rendezvous-timeout): is every pod of the"
                " group running and able to reach the leader?"
            )
        if progress is not None and missing != told:  # say it when it changes, not every poll
            progress(f"waiting for rank(s) {_ranks(missing)} of {layout.world_size} to join")
            told = missing
        time.sleep(0.2)


def _raise_if_failed(store: dist.Store) -> None:
    if store.check(["failed"]):
        raise GroupError(store.get("failed").decode())


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def init_process_group(
    store: dist.Store, layout: GroupLayout, rank: int, device: torch.device, address: str
) -> object | None:
    """Form the process group; returns this rank's tensor-parallel subgroup (None: the whole group)."""
    if device.type == "cuda":
        backend = "nccl"
    else:
        backend = _GLOO_BACKEND
        if _GLOO_BACKEND not in dist.Backend.backend_list:
            dist.Backend.register_backend(
                _GLOO_BACKEND, _gloo_on(address), extended_api=True, devices=["cpu"]
            )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=layout.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    if layout.pipeline_parallel == 1:
        return None
    mine = None
    for stage in range(layout.pipeline_parallel):  # every rank creates every group, in the same order
        group = dist.new_group(layout.stage_ranks(stage), timeout=COLLECTIVE_TIMEOUT)
        if stage == layout.stage(rank):
            mine = group
    return mine


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: str, local_rank: int) -> torch.device:
    """A rank's device: its node's GPU ``local_rank``, or the CPU."""
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# ---- membership: heartbeats, phases, failing as one ---------------------------------------------------


@dataclass
class Member:
    """This process's place in the group and the watch that ends it when the group breaks."""

    layout: GroupLayout
    rank: int
    address: GroupAddress
    timeouts: GroupTimeouts
    store: dist.Store
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # Run (on the failing thread) before the process exits: the leader fails requests in flight.
    on_failure: list[Callable[[str], None]] = field(default_factory=list)
    failure_grace_s: float = 0.0
    _failed: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _beats: dict[int, tuple[int, float]] = field(default_factory=dict)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def failed(self) -> str | None:
        return self._failed

    def report(self, phase: str, detail: str = "") -> None:
        """This rank's phase in the store, for the leader's and the node's health endpoints."""
        with contextlib.suppress(Exception):
            self.store.set(f"phase/{self.rank}", json.dumps({"phase": phase, "detail": detail}))

    def phases(self, ranks: Sequence[int]) -> dict[int, dict[str, object]]:
        """The last phase each of ``ranks`` reported (absent before it did)."""
        found = {}
        for r in ranks:
            with contextlib.suppress(Exception):
                if self.store.check([f"phase/{r}"]):
                    found[r] = _json(self.store, f"phase/{r}")
        return found

    def wait_ready(self, progress: Callable[[str], None]) -> None:
        """Until every rank has loaded its shard (reported ``ready``), telling ``progress`` who is late."""
        ranks = range(1, self.layout.world_size)
        told = ""
        while True:
            if self._failed is not None:
                raise GroupError(self._failed)
            phases = self.phases(ranks)
            late = [r for r in ranks if phases.get(r, {}).get("phase") != READY]
            if not late:
                return
            detail = "; ".join(f"rank {r}: {phases.get(r, {}).get('phase', JOINING)}" for r in late[:8])
            if detail != told:  # say it when it changes, not every poll
                progress(f"waiting for {len(late)} rank(s) to load their shards ({detail})")
                told = detail
            time.sleep(0.5)

    def diagnose(self, detail: str) -> str:
        """Why this rank's part broke (``detail``: what raised), as precisely as the store tells: another
        rank's reported failure, the leader gone (its store does not answer), or the error itself."""
        try:
            if self.store.check(["failed"]):
                return self.store.get("failed").decode()
        except Exception:
            return f"rank {self.rank}: the leader (rank 0) is gone: its store at {self.address} does not answer ({detail})"
        return f"rank {self.rank}: {detail}"

    def stale_ranks(self) -> list[int]:
        """Ranks whose heartbeat is late by more than two beats (not yet declared dead): the leader is
        not ready while any is."""
        now, late = time.monotonic(), []
        for r, (_, seen) in sorted(self._beats.items()):
            if now - seen > 2 * self.timeouts.beat_s + 1.0:
                late.append(r)
        return late

    # ---- the watch -----------------------------------------------------------------------------------

    def start_watch(self) -> None:
        """Heartbeat, and watch the others (the leader: every rank; a worker: the leader) on a thread with
        its own store connection."""
        threading.Thread(target=self._watch, name="group-watch", daemon=True).start()

    def _watch(self) -> None:
        try:
            client = dist.TCPStore(
                self.address.host,
                self.address.port,
                None,
                False,
                timeout=timedelta(seconds=self.timeouts.rank_s),
            )
        except Exception as exc:
            self.fail(f"rank {self.rank}: cannot reach the group's store at {self.address}: {exc}")
            return
        watched = range(1, self.layout.world_size) if self.is_leader else [0]
        start = time.monotonic()
        self._beats = {r: (-1, start) for r in watched}
        while not self._stopping.wait(self.timeouts.beat_s):
            try:
                client.add(f"beat/{self.rank}", 1)
                if client.check(["failed"]):
                    self.fail(client.get("failed").decode())
                    return
                now = time.monotonic()
                for r in watched:
                    count = client.add(f"beat/{r}", 0)
                    last, seen = self._beats[r]
                    if count != last:
                        self._beats[r] = (count, now)
                    elif now - seen > self.timeouts.rank_s:
                        who = "the leader (rank 0)" if r == 0 else f"rank {r} (node {self.layout.node(r)})"
                        self.fail(f"{who} stopped responding for {now - seen:.0f} s (--rank-timeout)")
                        return
            except Exception as exc:  # the store lives in the leader: it is gone
                if self._stopping.is_set():
                    return
                self.fail(
                    f"rank {self.rank}: lost the group's store at {self.address} (the leader is gone): {exc}"
                )
                return
            node_ranks = self.layout.node_ranks(self.layout.node(self.rank))[1:]
            for rank, child in zip(node_ranks, self.children, strict=False):
                code = child.poll()
                if code is not None and not self._stopping.is_set():
                    self.fail(f"rank {rank} (pid {child.pid}) exited with status {code}")
                    return

    def stop_watching(self) -> None:
        """A clean shutdown has begun: a peer leaving is no longer a failure."""
        self._stopping.set()

    def fail(self, reason: str) -> None:
        """End this process (status 1) because the group broke; first tell every rank (``failed`` in the
        store) and run ``on_failure``. Returns at once; idempotent."""
        with self._lock:
            if self._failed is not None or self._stopping.is_set():
                return
            self._failed = reason
        threading.Thread(target=self._exit, args=(reason,), name="group-fail", daemon=True).start()

    def _exit(self, reason: str) -> None:
        log.error("parallel group failed: %s; exiting", reason)
        with contextlib.suppress(Exception):
            if not self.store.check(["failed"]):
                self.store.set("failed", reason)
        for callback in self.on_failure:
            try:
                callback(reason)
            except Exception:
                log.exception("group failure callback failed")
        time.sleep(self.failure_grace_s)
        for child in self.children:
            with contextlib.suppress(OSError):
                child.kill()
        logging.shutdown()
        os._exit(1)

    def acknowledge_stop(self) -> None:
        """A non-leader rank got rank 0's stop: say so, so the leader may close the store behind it."""
        self.stop_watching()
        with contextlib.suppress(Exception):
            self.store.set(f"stopped/{self.rank}", "1")

    def wait_stopped(self, timeout_s: float) -> None:
        """On rank 0 after the stop: wait (bounded) until every rank acknowledged it; ranks still
        watching the store would otherwise take its closing for the leader's death."""
        keys = [f"stopped/{r}" for r in range(1, self.layout.world_size)]
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):
            while keys and not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.05)

    def wait_children(self, timeout_s: float) -> None:
        """After a clean stop: wait for this node's other ranks to leave, killing any that do not."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def spawn_node_ranks(
    serve_argv: Sequence[str], layout: GroupLayout, node: int, address: GroupAddress
) -> list[subprocess.Popen[bytes]]:
    """Start this node's ranks after its first as ``sovereign-runtime serve <same flags> --group-rank R
    --leader-address ADDRESS`` (before loading, so every rank reads its shard at the same time)."""
    ranks = layout.node_ranks(node)
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sovereign_runtime",
                *serve_argv,
                "--group-rank",
                str(rank),
                "--leader-address",
                str(address),
            ],
            stdin=subprocess.DEVNULL,
        )
        for rank in ranks[1:]
    ]


def exit_when_parent_dies() -> None:
    """In a subprocess rank: leave (status 1) once the node's first rank is gone."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=loop, name="group-parent-watch", daemon=True).start()
