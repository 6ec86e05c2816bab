"""glibc malloc settings for the serving process.

A forward's temporaries on CPU are multi-megabyte tensors (a 1000-token chunk's expanded K and V, its
products, the MoE's rows). With glibc's defaults, blocks that large are given back to the OS when freed
(mapped blocks unmapped, the heap's top trimmed past a threshold that follows the largest block freed), so
every forward faults its temporaries in again: about 28 000 minor page faults for a 1000-token prompt on
the benchmark's mid-size model, 10-15 % of that prefill's CPU time (docs/BENCHMARKS.md). A fixed mmap
threshold of 32 MiB (glibc's largest on 64-bit) and a trim threshold of 512 MiB keep freed blocks in the
heap for the next forward. The price: up to the trim threshold of freed memory per malloc arena stays with
the process instead of going back to the OS.

An operator who sets glibc's malloc tunables (``GLIBC_TUNABLES=glibc.malloc...``) keeps them.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Mapping

# mallopt(3) parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 512 << 20


def tune_malloc(environ: Mapping[str, str]) -> str:
    """Set the thresholds above where the allocator is glibc's and the environment does not set them;
    returns what was done, for the log."""
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "malloc left as GLIBC_TUNABLES sets it"
    if platform.libc_ver()[0] != "glibc":
        return "malloc defaults kept (the C library is not glibc)"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError) as exc:
        return f"malloc defaults kept (no mallopt: {exc})"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    refused = [
        name
        for name, param, value in (
            ("mmap", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            ("trim", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        )
        if mallopt(param, value) != 1
    ]
    if refused:
        return f"malloc: mallopt refused the {' and '.join(refused)} threshold"
    return (
        f"malloc: mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold "
        f"{TRIM_THRESHOLD_BYTES >> 20} MiB (freed forward temporaries stay in the heap)"
    )
