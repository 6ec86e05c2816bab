"""Achieved memory bandwidth of the Triton MLA decode kernel on a GPU (DeepSeek-V3 shapes).

    .venv/bin/python bench/mla_decode_bandwidth.py [--heads 128] [--peak-tbps 4.8] [--json out.json]

Decode attention is memory-bound: every step reads each sequence's whole latent cache (576 bf16 values per
token and layer for V3). The figure is bytes moved / kernel time, as a fraction of the device's peak HBM
bandwidth (4.8 TB/s on an H200). Bytes counted: the cache rows read, the queries and outputs, the block
tables, and the split-KV partial results written and read back by the merge step.

The script checks the kernel against the torch reference before timing anything and exits non-zero on a
mismatch or when no CUDA device is present. ``--cpu-dry-run`` (with TRITON_INTERPRET=1) runs the same code
path at toy sizes on CPU to check the script itself; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from sovereign_runtime.kernels.mla_decode import (
    default_num_splits,
    mla_decode_reference,
    mla_decode_triton,
)

KV_LORA_RANK = 512
ROPE_DIM = 64
SCALE = 0.13523  # V3's softmax scale (qk_head_dim^-0.5 × YaRN mscale²), passed explicitly


def make_inputs(
    batch: int,
    heads: int,
    context: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cuda",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = (context + block_size - 1) // block_size
    num_blocks = batch * blocks_per_seq
    width = KV_LORA_RANK + ROPE_DIM
    q = torch.randn(batch, heads, width, device=device, dtype=torch.float32, generator=g).to(dtype)
    cache = torch.randn(num_blocks, block_size, width, device=device, dtype=torch.float32, generator=g).to(
        dtype
    )
    # Scattered physical blocks, as a paged pool hands them out.
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    tables = perm.view(batch, blocks_per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, cache, tables, lens


def bytes_moved(
    batch: int, heads: int, context: int, num_splits: int, elem: int, tables: torch.Tensor
) -> int:
    width = KV_LORA_RANK + ROPE_DIM
    cache = batch * context * width * elem
    queries = batch * heads * width * elem
    outputs = batch * heads * KV_LORA_RANK * elem
    partials = 2 * batch * heads * num_splits * (KV_LORA_RANK + 1) * 4  # written, then read by the merge
    return cache + queries + outputs + partials + tables.numel() * 4


def self_check(heads: int, dtype: torch.dtype, device: str = "cuda") -> float:
    worst = 0.0
    cases = [(1, 1, 1), (3, 257, 4), (4, 1000, None), (2, 4096, 16)]
    if device == "cpu":
        cases = [(1, 1, 1), (2, 130, 3)]
    for batch, context, splits in cases:
        q, cache, tables, lens = make_inputs(batch, heads, context, 64, dtype, seed=batch, device=device)
        lens[0] = max(1, context // 3)  # ragged lengths
        got = mla_decode_triton(q, cache, tables, lens, SCALE, KV_LORA_RANK, num_splits=splits)
        ref = mla_decode_reference(q, cache, tables, lens, SCALE, KV_LORA_RANK)
        err = float((got.float() - ref.float()).abs().max())
        worst = max(worst, err)
        if not torch.isfinite(got).all() or err > 3e-2:
            raise SystemExit(f"MISMATCH batch={batch} context={context} splits={splits}: max error {err}")
    return worst


def time_kernel(fn, iters: int = 50, warmup: int = 10) -> float:
    if not torch.cuda.is_available():  # --cpu-dry-run: wall clock, one call
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3  # seconds per call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128, help="query heads per GPU (128 for V3 without TP)")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="device peak HBM bandwidth in TB/s")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="check the script on CPU (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    device = "cuda"
    if args.cpu_dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("mla_decode_bandwidth: --cpu-dry-run needs TRITON_INTERPRET=1 in the environment")
            return 2
        device, args.heads, args.batches, args.contexts = "cpu", 16, [2], [200]
    elif not torch.cuda.is_available():
        print(
            "mla_decode_bandwidth: needs a CUDA GPU (Triton timings under the CPU interpreter mean nothing)"
        )
        return 2

    # The interpreter has no bf16 dot; the dry run uses fp32 (the kernel casts to fp32 there anyway).
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    elem = torch.tensor([], dtype=dtype).element_size()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    print(f"device: {name}; heads {args.heads}; {dtype}; 64-token pages")
    print(f"self-check vs torch reference: max abs error {self_check(args.heads, dtype, device):.2e} (ok)")
    rows = []
    print("| batch | context | splits | time (µs) | GB/s | fraction of peak |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for context in args.contexts:
        for batch in args.batches:
            q, cache, tables, lens = make_inputs(batch, args.heads, context, 64, dtype, device=device)
            splits = default_num_splits(batch, args.heads, context)
            call = partial(mla_decode_triton, q, cache, tables, lens, SCALE, KV_LORA_RANK, splits)
            seconds = time_kernel(call)
            moved = bytes_moved(batch, args.heads, context, splits, elem, tables)
            gbps = moved / seconds / 1e9
            fraction = gbps / (args.peak_tbps * 1e3)
            rows.append(
                {"batch": batch, "context": context, "splits": splits, "seconds": seconds, "bytes": moved,
                 "gb_per_s": gbps, "fraction_of_peak": fraction}
            )  # fmt: skip
            print(f"| {batch} | {context} | {splits} | {seconds * 1e6:.1f} | {gbps:.0f} | {fraction:.1%} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
