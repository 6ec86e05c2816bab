"""A fixed paged-cache scenario (batched prefill, decode steps, a mixed prefill + decode batch) whose logits
the tensor-parallel tests compare across world sizes.

As a script (``python tp_support.py CHECKPOINT WORLD_SIZE OUT``) it runs the scenario as rank 0 of a CPU
tensor-parallel group, with the workers started exactly as ``serve --tensor-parallel-size`` starts them,
and saves the result with ``torch.save``.

``python tp_support.py rows RANK RENDEZVOUS OUT`` is one rank of a world of 2 for the KV-row broadcast:
rank 0 writes ``ROW_WRITES`` through a ``TensorParallelLeader`` into a cache of each of ``ROW_DTYPES``, rank 1
follows with ``run_worker``; each saves the caches it ended up with.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from sovereign_runtime.model import PagedRunner

PROMPT_LENGTHS = (3, 9, 14)
LATE_PROMPT_LENGTH = 7
DECODE_STEPS = 4


def run_scenario(model: Any) -> dict[str, Any]:
    """Logits of every step and the greedy tokens, for ``model`` (a plain model or a TP leader)."""
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
        self.config = None
        self.caches: list[torch.Tensor] = []

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.caches.append(cache)


def _rows_main(rank: int, rendezvous: str, out: str) -> None:
    from sovereign_runtime.engine.tensor_parallel import (
        TensorParallelLeader,
        destroy_process_group,
        init_process_group,
        run_worker,
    )

    device = torch.device("cpu")
    init_process_group(rank, 2, rendezvous, device)
    holder = _CacheHolder()
    result: dict[str, Any] = {}
    if rank == 0:
        leader = TensorParallelLeader(holder)
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
        run_worker(holder, device)
    destroy_process_group()
    result["caches"] = holder.caches
    torch.save(result, out)


def _main(checkpoint: str, world_size: int, out: str) -> None:
    from sovereign_runtime.engine.tensor_parallel import (
        TensorParallelLeader,
        destroy_process_group,
        init_process_group,
        spawn_workers,
    )
    from sovereign_runtime.model import load_model
    from sovereign_runtime.model.parallel import TensorParallel

    argv = ["serve", "--model", checkpoint, "--device", "cpu", "--tensor-parallel-size", str(world_size)]
    group = spawn_workers(argv, world_size)
    group.watch()
    init_process_group(0, world_size, group.rendezvous_file, torch.device("cpu"))
    model, _ = load_model(checkpoint, "cpu", tensor_parallel=TensorParallel(0, world_size))
    leader = TensorParallelLeader(model)
    result = run_scenario(leader)
    torch.save(result, out)
    group.expect_exit()
    leader.stop_workers()
    group.stop()
    destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "rows":
        _rows_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        _main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
