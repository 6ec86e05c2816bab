"""A fixed paged-cache scenario (batched prefill, decode steps, a mixed prefill + decode batch) whose logits
the tensor-parallel tests compare across world sizes.

As a script (``python tp_support.py CHECKPOINT WORLD_SIZE OUT``) it runs the scenario as rank 0 of a CPU
tensor-parallel group, with the workers started exactly as ``serve --tensor-parallel-size`` starts them,
and saves the result with ``torch.save``.
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
    _main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
