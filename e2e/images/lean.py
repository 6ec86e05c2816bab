"""The CPU flavour of the runtime image: PyPI's CUDA torch wheel, without what a CPU never loads.

PyPI's torch wheel for Linux is built against CUDA: ``import torch`` loads ``libtorch_cuda.so``, and
with it (DT_NEEDED) cuBLAS, cuFFT, cuSPARSE, cuSPARSELt, NCCL, NVSHMEM, NVRTC, cuDNN's front library
and the CUDA runtime, even on a machine without a GPU. Most of the 3 GB of ``nvidia/*`` is only
``dlopen``ed on demand on a GPU (cuDNN's engine libraries, cuSOLVER, nvJitLink, nvperf, NVSHMEM
transports) or never loaded at all (static archives, headers, LLVM bitcode). Measured on this
machine (docs/BENCHMARKS.md), the CPU flavour keeps:

- under ``nvidia/`` and ``torch/lib/``: exactly the shared libraries the dynamic loader must find,
  i.e. the DT_NEEDED closure (resolved through each object's RUNPATH, ``$ORIGIN`` expanded) of every
  other native file in the image plus ``libtorch_global_deps.so``, which ``torch/__init__.py`` loads
  with ctypes; every other file there is left out;
- no ``triton``: nothing imports it without CUDA (the runtime's Triton kernels run only on CUDA
  tensors; torch treats triton as optional and checks for it with ``find_spec``);
- no ``torch/include`` (C++ headers for building extensions; the image has no compiler).

``torch/__init__.py`` also *preloads*, best effort, a list of CUDA libraries when they are present
(cuSOLVER, nvJitLink, NVRTC's builtins among them): that is why they show in ``/proc/self/maps`` of a
full install, and why leaving them out changes nothing on a CPU.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elf import Dynamic, expand_origin, is_elf, read_dynamic

# Distributions a CPU never imports, with the reason (checked by the image's serving test).
CPU_DROPPED_DISTRIBUTIONS = {
    "triton": "GPU kernels only; torch and the runtime import it only for CUDA tensors",
}
# Trees where only the shared libraries the loader needs are kept (relative to site-packages).
PRUNED_LIBRARY_TREES = ("nvidia/", "torch/lib/")
# Libraries loaded with ctypes rather than through DT_NEEDED (torch/__init__.py's _load_global_deps).
CTYPES_ROOTS = ("torch/lib/libtorch_global_deps.so",)
# Trees left out of the CPU flavour entirely, with the reason.
CPU_DROPPED_TREES = {
    "torch/include/": "C++ headers for building extensions; the image has no compiler",
}
# Provided at run time by the host on GPU nodes (NVIDIA container toolkit), never part of an image.
DRIVER_LIBRARIES = frozenset({"libcuda.so.1", "libnvidia-ml.so.1"})


@dataclass
class Selection:
    """What the CPU flavour keeps of a set of site-packages files, and why the rest is left out."""

    kept: dict[str, Path] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # relative path -> reason


def _pruned(rel: str) -> bool:
    return rel.startswith(PRUNED_LIBRARY_TREES)


def select_cpu(files: Mapping[str, Path], distribution_of: Mapping[str, str]) -> Selection:
    """Apply the CPU rules to ``files`` (path relative to site-packages -> source on this machine);
    ``distribution_of`` maps each path to its distribution's canonical name."""
    selection = Selection()
    candidates: dict[str, Path] = {}
    for rel, source in files.items():
        dist = distribution_of.get(rel, "")
        if dist in CPU_DROPPED_DISTRIBUTIONS:
            selection.dropped[rel] = f"{dist}: {CPU_DROPPED_DISTRIBUTIONS[dist]}"
            continue
        tree = next((t for t in CPU_DROPPED_TREES if rel.startswith(t)), None)
        if tree is not None:
            selection.dropped[rel] = CPU_DROPPED_TREES[tree]
            continue
        candidates[rel] = source

    elves = {rel: src for rel, src in candidates.items() if is_elf(src)}
    dynamic = {rel: read_dynamic(src) for rel, src in elves.items()}
    roots = [rel for rel in elves if not _pruned(rel) or rel in CTYPES_ROOTS]
    needed = needed_closure(roots, dynamic)
    for rel, source in candidates.items():
        if not _pruned(rel) or rel in needed:
            selection.kept[rel] = source
        elif rel in elves:
            selection.dropped[rel] = "shared library no kept object needs (dlopened on GPUs only)"
        elif rel.endswith(".py"):
            selection.kept[rel] = source  # namespace package markers
        else:
            selection.dropped[rel] = "not a shared library (headers, static archives, bitcode, cmake)"
    return selection


def resolve_needed(
    rel: str, name: str, dynamic: Mapping[str, Dynamic], by_name: Mapping[str, list[str]]
) -> str | None:
    """The file (relative to site-packages) the loader maps for ``name`` needed by ``rel``: first
    through ``rel``'s RUNPATH, else a library of that name elsewhere in site-packages (torch preloads
    those); None when it is not in site-packages (the system's, or the driver's)."""
    origin = posixpath.dirname(rel)
    for directory in dynamic[rel].runpath:
        expanded = expand_origin(directory, origin)
        if expanded.startswith("/"):
            continue  # an absolute path on the build machine of the wheel: not in the image
        candidate = posixpath.normpath(posixpath.join(expanded, name))
        if candidate in dynamic:
            return candidate
    matches = by_name.get(name, [])
    return matches[0] if matches else None


def needed_closure(roots: list[str], dynamic: Mapping[str, Dynamic]) -> set[str]:
    """Every site-packages library reachable from ``roots`` through DT_NEEDED (roots included)."""
    by_name: dict[str, list[str]] = {}
    for rel, info in dynamic.items():
        by_name.setdefault(posixpath.basename(rel), []).append(rel)
        if info.soname and info.soname != posixpath.basename(rel):
            by_name.setdefault(info.soname, []).append(rel)
    for names in by_name.values():
        names.sort()
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        rel = stack.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for name in dynamic[rel].needed:
            found = resolve_needed(rel, name, dynamic, by_name)
            if found is not None and found not in seen:
                stack.append(found)
    return seen


def missing_libraries(
    files: Mapping[str, Path], system_libraries: set[str], skip: frozenset[str] = DRIVER_LIBRARIES
) -> dict[str, list[str]]:
    """What the loader would not find: for each native file of ``files`` (relative to site-packages)
    its DT_NEEDED names found neither in site-packages nor among ``system_libraries`` (the base
    root filesystem's). An empty result is ``ldd`` reporting nothing missing, without running it."""
    dynamic = {rel: read_dynamic(src) for rel, src in files.items() if is_elf(src)}
    by_name: dict[str, list[str]] = {}
    for rel, info in dynamic.items():
        by_name.setdefault(posixpath.basename(rel), []).append(rel)
        if info.soname:
            by_name.setdefault(info.soname, []).append(rel)
    missing: dict[str, list[str]] = {}
    for rel, info in sorted(dynamic.items()):
        for name in info.needed:
            if name in system_libraries or name in skip:
                continue
            if resolve_needed(rel, name, dynamic, by_name) is None:
                missing.setdefault(rel, []).append(name)
    return missing
