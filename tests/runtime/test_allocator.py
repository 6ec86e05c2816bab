"""The serving process's malloc settings (sovereign_runtime/allocator.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
from sovereign_runtime.allocator import tune_malloc

# A fresh process without torch: where glibc puts a 24 MiB block (its own mapping by default, the heap once
# the mmap threshold is 32 MiB) and whether freeing it gives the heap's top back to the OS.
_WHERE_A_BLOCK_GOES = """
import ctypes, sys
from sovereign_runtime.allocator import tune_malloc
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = [ctypes.c_ssize_t]
if sys.argv[1] == "tuned":
    print(tune_malloc({}), file=sys.stderr)
before = libc.sbrk(0)  # the heap grows for a block it serves; a mapping lies elsewhere
block = libc.malloc(24 << 20)
grown = libc.sbrk(0)
libc.free(block)
print(grown > before and block + (24 << 20) <= grown, libc.sbrk(0) == grown)
"""


def _where_a_block_goes(mode: str) -> tuple[bool, bool]:
    done = subprocess.run(
        [sys.executable, "-c", _WHERE_A_BLOCK_GOES, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    in_heap, kept = done.stdout.split()
    return in_heap == "True", kept == "True"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_large_blocks_come_from_the_heap_and_stay_there_once_tuned() -> None:
    in_heap, _ = _where_a_block_goes("plain")
    assert not in_heap, "glibc's defaults already serve a 24 MiB block from the heap"
    in_heap, kept = _where_a_block_goes("tuned")
    assert in_heap, "with the 32 MiB mmap threshold a 24 MiB block should come from the heap"
    assert kept, "with the 512 MiB trim threshold freeing the block should keep the heap's top"


def test_an_operators_own_malloc_tunables_are_kept() -> None:
    said = tune_malloc({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"})
    assert said == "malloc left as GLIBC_TUNABLES sets it"
