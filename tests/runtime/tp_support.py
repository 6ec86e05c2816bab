"""A fixed paged-cache scenario (batched prefill, decode steps, a mixed prefill + decode batch) whose logits
the parallel tests compare across layouts.

As a script (``python tp_support.py CHECKPOINT TP PP OUT``) it runs the scenario as rank 0 of a CPU group
of TP x PP ranks on one node, the other ranks started exactly as ``serve`` starts them, and saves the result
with ``torch.save``.

``python tp_support.py rows RANK PORT OUT`` is one rank of a tensor-parallel world of 2 for the KV-row
broadcast: rank 0 writes ``ROW_WRITES`` through a ``GroupLeader`` into a cache of each of ``ROW_DTYPES``,
rank 1 follows with ``run_worker``; each saves the caches it ended up with.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from sovereign_runtime.model import PagedRunner

PROMPT_LENGTHS = (3, 9, 14)
LATE_PROMPT_LENGTH = 7
DECODE_STEPS = 4


def run_scenario(model: Any) -> dict[str, Any]:
    """Logits of every step and the greedy tokens, for ``model`` (a plain model or a group's leader)."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    late_prompt = torch.randint(2, vocab, (LATE_PROMPT_LENGTH,), generator=generator).tolist()
    # Block size 4: every sequence spans several scrambled blocks.
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    sids = [runner.new_sequence() for _ in prompts]
    prefill = runner.step(list(zip(sids, prompts, strict=True)), all_logits=True)
    last_rows = torch.tensor(PROMPT_LENGTHS).cumsum(0) - 1
    tokens = prefill[last_rows].argmax(-1).tolist()
    greedy: list[list[int]] = [[t] for t in tokens]
    decode = []
    for _ in range(DECODE_STEPS):
        logits = runner.step([(sid, [t]) for sid, t in zip(sids, tokens, strict=True)])
        decode.append(logits)
        tokens = logits.argmax(-1).tolist()
        for out, t in zip(greedy, tokens, strict=True):
            out.append(t)
    # A mixed batch: the running sequences decode while a new prompt prefills.
    late = runner.new_sequence()
    work = [*((sid, [t]) for sid, t in zip(sids, tokens, strict=True)), (late, late_prompt)]
    mixed = runner.step(work, all_logits=True)
    return {"prefill": prefill, "decode": torch.stack(decode), "mixed": mixed, "greedy": greedy}


ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
ROW_CACHE_SHAPE = (3, 8, 4, 6)  # layers, blocks, block size, kv width
# (layer, flat slot indices) of each write; the rows are random and saved with the caches.
ROW_WRITES = ((0, (5, 6, 7, 20)), (2, (31, 0, 9)), (1, (12,)))


class _CacheHolder(torch.nn.Module):
    """A stand-in model that only keeps every KV cache bound to it."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the leader reads its device from a parameter
        self.config = SimpleNamespace(num_hidden_layers=ROW_CACHE_SHAPE[0], num_nextn_predict_layers=0)
        self.caches: list[torch.Tensor] = []

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.caches.append(cache)


def _rows_main(rank: int, port: int, out: str) -> None:
    from sovereign_runtime.assembly import connect_group, member_of
    from sovereign_runtime.engine.group import (
        GroupAddress,
        GroupLayout,
        GroupTimeouts,
        destroy_process_group,
        init_process_group,
        rendezvous,
    )
    from sovereign_runtime.engine.tensor_parallel import GroupLeader, Placement, run_worker
    from sovereign_runtime.model.pipeline import PipelineStage

    layout = GroupLayout(2, 1, 1)
    group = connect_group(layout, rank, GroupAddress("127.0.0.1", port), GroupTimeouts(60, 30), "127.0.0.1")
    rendezvous(group.store, layout, rank, "127.0.0.1", 60)
    device = torch.device("cpu")
    init_process_group(group.store, layout, rank, device, "127.0.0.1")
    place = Placement(layout, rank, PipelineStage(0, 1, range(ROW_CACHE_SHAPE[0])), None, device)
    holder = _CacheHolder()
    result: dict[str, Any] = {}
    if rank == 0:
        leader = GroupLeader(holder, place, member_of(group, 0))
        generator = torch.Generator().manual_seed(3)
        written = []
        for dtype in ROW_DTYPES:
            leader.bind_kv_cache(torch.zeros(ROW_CACHE_SHAPE, dtype=dtype))
            for layer, slot_list in ROW_WRITES:
                rows = torch.randn(len(slot_list), ROW_CACHE_SHAPE[-1], generator=generator).to(dtype)
                leader.write_kv_rows(layer, torch.tensor(slot_list), rows)
                written.append(rows)
        leader.stop_workers()
        result["written"] = written
    else:
        run_worker(holder, place)
    destroy_process_group()
    result["caches"] = holder.caches
    torch.save(result, out)


def _main(checkpoint: str, tp: int, pp: int, out: str) -> None:
    from sovereign_runtime.assembly import connect_group, load_group_leader, member_of
    from sovereign_runtime.engine.group import GroupAddress, GroupLayout, GroupTimeouts, spawn_node_ranks

    layout = GroupLayout(tp, pp, 1)
    group = connect_group(layout, 0, GroupAddress("127.0.0.1", 0), GroupTimeouts(120, 30), "127.0.0.1")
    argv = ["serve", "--model", checkpoint, "--device", "cpu", "--tensor-parallel-size", str(tp)]
    group.children = spawn_node_ranks([*argv, "--pipeline-parallel-size", str(pp)], layout, 0, group.address)
    member = member_of(group, 0)
    leader = load_group_leader(Path(checkpoint), group, member, "cpu", None, lambda *_: None)
    result = run_scenario(leader)
    torch.save(result, out)
    leader.stop_workers()
    member.wait_stopped(10)
    member.wait_children(10)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "rows":
        _rows_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
