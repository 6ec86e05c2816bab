"""The runtime's assembly: a checkpoint becomes a running engine the HTTP server can serve.

Tokenizer, weights (one rank, or this rank's part of a parallel group), KV pool and the engine thread,
reported phase by phase while the server already answers probes. This module stands above the engine and
the server: the server only serves the ``LoadedRuntime`` it is handed, and the CLI wires the two together
(``cli.py``). The ranks of a parallel group other than rank 0 run ``serve_rank`` instead.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .builtin import resolve_builtin
from .engine.async_engine import AsyncEngine
from .engine.engine import EngineConfig, LLMEngine
from .engine.grammar import Grammars
from .engine.group import (
    JOINING,
    LOADING,
    READY,
    GroupAddress,
    GroupError,
    GroupLayout,
    GroupTimeouts,
    Member,
    connect_store,
    destroy_process_group,
    init_process_group,
    rank_device,
    rendezvous,
)
from .engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from .engine.selftest import prepare_output_guard
from .engine.speculative import SpeculativeConfig
from .engine.tensor_parallel import GroupFailure, GroupLeader, Placement, collective_error, run_worker
from .model import load_model
from .model.config import ModelConfig
from .model.faults import FaultSpec
from .model.parallel import TensorParallel, set_tensor_parallel_group, tensor_parallel_problem
from .model.pipeline import PipelineStage, pipeline_parallel_problem
from .server.state import LoadedRuntime, Loader, ProgressFn
from .tokenizer import Tokenizer

DTYPES = ("float32", "bfloat16", "float16")

log = logging.getLogger("sovereign_runtime")


@dataclass
class EngineOptions:
    model_path: Path
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_cache_gib: float | None = None
    num_kv_blocks: int | None = None
    # Set when serving over several ranks (--tensor-parallel-size/--pipeline-parallel-size > 1): this
    # process is rank 0 of the group.
    group: GroupStart | None = None
    # The output self-test before ready and periodically (engine/selftest.py), and a test-only fault.
    self_test: bool = True
    fault: FaultSpec | None = None
    # MTP speculative decoding (--speculative-*); off by itself when the checkpoint has no MTP layer.
    speculative: SpeculativeConfig | None = None
    # --chat-template: the text of a template used in place of the tokenizer's own.
    chat_template: str | None = None


@dataclass
class GroupStart:
    """What rank 0 needs to bring its group up: the CLI made the store (rank 0 hosts it) and started the
    node's other ranks."""

    layout: GroupLayout
    address: GroupAddress  # the store's, with its real port
    store: dist.TCPStore
    timeouts: GroupTimeouts
    node_address: str  # this node's own address for the group's connections
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA device is available")
    return device


def resolve_dtype(dtype: str) -> torch.dtype | None:
    """None for ``auto`` (the checkpoint's own dtype)."""
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)  # type: ignore[no-any-return]


def load_runtime(options: EngineOptions, progress: ProgressFn) -> LoadedRuntime:
    """Load everything the server needs; runs in a worker thread while HTTP already answers probes."""
    progress("loading_weights", 0.0, "reading the tokenizer")
    tokenizer = Tokenizer.from_dir(options.model_path)
    if options.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(options.chat_template)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype)
    progress("loading_weights", 0.05, f"loading weights from {options.model_path} onto {device}")
    group = options.group
    member = None
    if group is None:
        model, _config = load_model(options.model_path, device, dtype)
    else:
        member = member_of(group, 0)
        try:
            model = load_group_leader(options.model_path, group, member, device, dtype, progress)
        except Exception as exc:
            member.fail(
                f"rank 0: {exc}" if isinstance(exc, GroupError) else f"rank 0: {type(exc).__name__}: {exc}"
            )
            raise
    progress("loading_weights", 0.9, "allocating the KV cache")
    speculative, unavailable = options.speculative, None
    if speculative is not None and not len(getattr(model, "mtp", ())):
        unavailable = getattr(model, "mtp_unavailable", None) or (
            "config.json declares no MTP layer (num_nextn_predict_layers 0)"
        )
        log.warning("--speculative-algorithm %s asked for, but %s: serving without speculative decoding",
                    speculative.algorithm, unavailable)  # fmt: skip
        speculative = None
    config = EngineConfig(
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=options.max_model_len,
        num_kv_blocks=options.num_kv_blocks,
        kv_cache_gib=options.kv_cache_gib,
        device=device,
        dtype=dtype,
        speculative=speculative,
    )
    core = LLMEngine.from_model(model, config)
    core.speculative_unavailable = unavailable
    stop_ids = sorted(core.scheduler.eos_token_ids) or [t for t in (tokenizer.eos_token_id,) if t is not None]
    core.runner.grammars = Grammars(tokenizer, core.vocab_size, stop_ids)
    engine = AsyncEngine(core)
    # builtin:sovereign-tiny knows its exact answers; any model gets batch invariance, numerics, weights.
    tiny = options.model_path.resolve() == resolve_builtin("sovereign-tiny").resolve()
    self_test, saturated = prepare_output_guard(
        engine, tokenizer, self_test=options.self_test, known_answers=tiny, fault=options.fault
    )
    progress("loading_weights", 1.0, "weights loaded")
    if member is not None:
        # The group broke (a rank died or went silent): requests in flight end with an error naming it,
        # then the process exits (Member.fail) and the orchestrator starts the group again.
        member.on_failure.append(
            lambda reason: engine.fail_streams(GroupFailure(f"{reason}; this replica restarts"))
        )
        member.failure_grace_s = 1.0
    return LoadedRuntime(
        engine=engine,
        tokenizer=tokenizer,
        max_model_len=engine.max_model_len,
        self_test=self_test,
        saturated=saturated,
        speculative=speculative_card(options.speculative, speculative is not None, unavailable),
        close=engine.shutdown if member is None else lambda: _close_group(engine, model, member),
        group_problem=None if member is None else lambda: _group_problem(member),
    )


def speculative_card(
    requested: SpeculativeConfig | None, enabled: bool, unavailable: str | None
) -> dict[str, Any]:
    """What ``/v1/models`` says about speculative decoding."""
    if requested is None:
        return {"enabled": False}
    card: dict[str, Any] = {
        "enabled": enabled,
        "algorithm": requested.algorithm,
        "num_draft_tokens": requested.num_draft_tokens,
        "max_batch_size": requested.max_batch_size,
    }
    if unavailable is not None:
        card["reason"] = unavailable
    return card


def make_loader(options: EngineOptions) -> Loader:
    return lambda progress: load_runtime(options, progress)


# ---- parallel groups (engine/group.py lays them out, engine/tensor_parallel.py runs their steps) --------


def parallel_problem_for(model_path: Path, layout: GroupLayout, device: str) -> str | None:
    """Why this checkpoint or machine cannot run ``layout``, or None; read before starting anything."""
    config = ModelConfig.from_pretrained(model_path)
    problem = (
        layout.problem()
        or tensor_parallel_problem(config, layout.tensor_parallel)
        or pipeline_parallel_problem(config, layout.pipeline_parallel)
    )
    if problem:
        return problem
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        visible = torch.cuda.device_count()
        if layout.ranks_per_node > visible:
            return (
                f"{layout.ranks_per_node} rank(s) per node (--tensor-parallel-size x --pipeline-parallel-size"
                f" / --nnodes) need {layout.ranks_per_node} CUDA devices; {visible} visible"
            )
    return None


def member_of(group: GroupStart, rank: int) -> Member:
    return Member(group.layout, rank, group.address, group.timeouts, group.store, group.children)


def _place(
    layout: GroupLayout, rank: int, config: ModelConfig, tp_group: Any, device: torch.device
) -> Placement:
    stage = PipelineStage.of(config, layout.stage(rank), layout.pipeline_parallel)
    return Placement(layout, rank, stage, tp_group, device)


def _join(
    group: GroupStart, member: Member, rank: int, device: str, report: Callable[[str], None]
) -> tuple[torch.device, Any]:
    """Rendezvous with the whole group, start the heartbeat watch, form the process group."""
    member.report(JOINING)
    rendezvous(group.store, group.layout, rank, group.node_address, group.timeouts.rendezvous_s, report)
    member.start_watch()
    torch_device = rank_device(device, group.layout.local_rank(rank))
    tp_group = init_process_group(group.store, group.layout, rank, torch_device, group.node_address)
    return torch_device, tp_group


def _load_rank(model_path: Path, place: Placement, dtype: torch.dtype | None) -> torch.nn.Module:
    layout = place.layout
    tp = TensorParallel(layout.tp_rank(place.rank), layout.tensor_parallel)
    model, _ = load_model(model_path, place.device, dtype, tensor_parallel=tp, pipeline=place.stage)
    if place.tp_group is not None:
        set_tensor_parallel_group(model, place.tp_group)
    return model


def load_group_leader(
    model_path: Path,
    group: GroupStart,
    member: Member,
    device: str,
    dtype: torch.dtype | None,
    progress: ProgressFn,
) -> GroupLeader:
    """Rank 0: join the group, load its part, wait until every rank has loaded its own."""
    layout = group.layout
    progress(
        "joining_group",
        0.0,
        f"{layout.world_size} ranks on {layout.nnodes} node(s) meeting at {group.address}",
    )
    torch_device, tp_group = _join(
        group, member, 0, device, lambda text: progress("joining_group", 0.5, text)
    )
    config = ModelConfig.from_pretrained(model_path)
    place = _place(layout, 0, config, tp_group, torch_device)
    progress(
        "loading_weights", 0.05, f"loading stage {place.stage.index}'s shard 0 of {layout.tensor_parallel}"
    )
    model = _load_rank(model_path, place, dtype)
    member.report(READY)
    # The slowest rank decides when the replica can start: say which ones are still loading.
    member.wait_ready(lambda text: progress("loading_weights", 0.85, text))
    return GroupLeader(model, place, member)


def _group_problem(member: Member) -> str | None:
    """Why the leader must not take traffic although it runs: a rank whose heartbeat is late."""
    if member.failed is not None:
        return member.failed
    late = member.stale_ranks()
    return f"rank(s) {', '.join(map(str, late))} late on their heartbeat" if late else None


def _close_group(engine: AsyncEngine, leader: GroupLeader, member: Member) -> None:
    """Stop stepping, then release the other ranks (they exit 0) and leave the process group."""
    engine.shutdown()
    leader.stop_workers()
    member.wait_stopped(timeout_s=10.0)
    member.wait_children(timeout_s=10.0)
    destroy_process_group()


def serve_rank(
    model_path: Path,
    device: str,
    dtype: str,
    group: GroupStart,
    rank: int,
    on_member: Callable[[Member], None] | None = None,
) -> int:
    """A rank other than 0, its whole life: join the group, load its part, follow rank 0 until it stops.

    Any failure (the group never forms, a load error, a broken collective) fails the whole group with a
    line naming this rank and why (``Member.fail``: this process exits with status 1). ``on_member``
    sees the membership first (the node's health endpoint reads its phases)."""
    # A terminal's Ctrl-C or a SIGTERM (a pod being deleted) reaches the other ranks too: they leave when
    # rank 0 tells them (after its drain) or when it is gone, never on their own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    member = member_of(group, rank)
    if on_member is not None:
        on_member(member)
    try:
        torch_device, tp_group = _join(group, member, rank, resolve_device(device), lambda _text: None)
        config = ModelConfig.from_pretrained(model_path)
        place = _place(group.layout, rank, config, tp_group, torch_device)
        member.report(LOADING)
        model = _load_rank(model_path, place, resolve_dtype(dtype))
        member.report(READY)
        run_worker(model, place)
    except Exception as exc:
        member.fail(str(exc) if isinstance(exc, GroupError) else member.diagnose(collective_error(exc)))
        threading.Event().wait()  # Member.fail ends the process
    member.acknowledge_stop()
    member.wait_children(timeout_s=10.0)
    destroy_process_group()
    return 0


def connect_group(
    layout: GroupLayout, rank: int, address: GroupAddress, timeouts: GroupTimeouts, node_address: str
) -> GroupStart:
    """This rank's connection to the group's store (rank 0: hosting it), as a ``GroupStart``."""
    store = connect_store(address, rank, layout.world_size, timeouts.rendezvous_s)
    if rank == 0:
        address = GroupAddress(address.host, store.port)
    return GroupStart(layout, address, store, timeouts, node_address)
