"""The MLA decode kernel: torch reference vs a plain loop, and Triton vs the reference under TRITON_INTERPRET=1.

The interpreter must be switched on before Triton is imported, so the Triton comparison runs this file as a
script in a fresh process (``python test_kernel_mla_decode.py``) and checks what it reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# (batch, heads, kv_lora_rank, rope_dim, block_size, context lens, num_splits, dtype)
CASES: list[tuple[int, int, int, int, int, list[int], int | None, str]] = [
    (3, 5, 32, 8, 16, [1, 37, 70], 1, "float32"),  # tiny-model dims, heads not a multiple of 16
    (3, 5, 32, 8, 16, [1, 37, 70], 4, "float32"),  # split-KV with an empty split for the short sequence
    (2, 16, 512, 64, 64, [130, 64], 3, "float32"),  # V3 widths (576 = 512 + 64), FlashMLA's 64-token pages
    (2, 4, 32, 8, 16, [50, 20], None, "bfloat16"),  # bf16 cache, default split count
]


def _paged_inputs(
    batch: int,
    heads: int,
    rank: int,
    rope: int,
    block: int,
    lens: list[int],
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block - 1) // block for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    q = torch.randn(batch, heads, rank + rope, generator=g).to(dtype)
    kv = torch.randn(num_blocks, block, rank + rope, generator=g).to(dtype)
    tables = torch.full((batch, max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g)  # scattered physical blocks
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return q, kv, tables, torch.tensor(lens, dtype=torch.int32)


def _loop_reference(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
                    rank: int) -> torch.Tensor:  # fmt: skip
    """One sequence at a time, straight from the definition: softmax(q·Kᵀ·scale)·V with K = row, V = latent."""
    block = kv.shape[1]
    out = []
    for b in range(q.shape[0]):
        rows = torch.stack([kv[tables[b, t // block], t % block] for t in range(int(lens[b]))]).double()
        probs = torch.softmax(q[b].double() @ rows.T * scale, dim=-1)
        out.append(probs @ rows[:, :rank])
    return torch.stack(out)


def test_reference_matches_plain_loop() -> None:
    from sovereign_runtime.kernels import mla_decode, mla_decode_reference

    for batch, heads, rank, rope, block, lens, _, _ in CASES[:3]:
        q, kv, tables, ctx = _paged_inputs(batch, heads, rank, rope, block, lens, torch.float32)
        expected = _loop_reference(q, kv, tables, ctx, 0.135, rank)
        got = mla_decode_reference(q, kv, tables, ctx, 0.135, rank)
        assert got.shape == (batch, heads, rank) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
        # On CPU the dispatcher uses the reference.
        assert torch.equal(mla_decode(q, kv, tables, ctx, 0.135, rank), got)


def _interpreted_errors() -> list[dict[str, object]]:
    from sovereign_runtime.kernels import mla_decode_reference, mla_decode_triton

    results = []
    for batch, heads, rank, rope, block, lens, splits, dtype_name in CASES:
        dtype = getattr(torch, dtype_name)
        q, kv, tables, ctx = _paged_inputs(batch, heads, rank, rope, block, lens, dtype)
        got = mla_decode_triton(q, kv, tables, ctx, 0.135, rank, num_splits=splits)
        ref = mla_decode_reference(q, kv, tables, ctx, 0.135, rank)
        results.append(
            {
                "case": [batch, heads, rank, rope, block, lens, splits, dtype_name],
                "dtype": str(got.dtype).replace("torch.", ""),
                "shape": list(got.shape),
                "max_err": float((got.float() - ref.float()).abs().max()),
            }
        )
    return results


def test_triton_matches_reference_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(CASES)
    for r in results:
        case = r["case"]
        assert r["dtype"] == case[-1] and r["shape"] == [case[0], case[1], case[2]], r
        tolerance = 1e-5 if case[-1] == "float32" else 2e-2  # bf16 output rounding
        assert r["max_err"] <= tolerance, r


if __name__ == "__main__":  # the interpreter-side half of the test above
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
    print(json.dumps(_interpreted_errors()))
