"""What the dynamic loader reads from an ELF file: its DT_NEEDED names, RUNPATH/RPATH and SONAME.

The image build keeps a shared library of the CPU flavour only when the loader needs it, so it reads
the dynamic section the way ld.so does: through the program headers (PT_DYNAMIC, and PT_LOAD to map
DT_STRTAB's address to a file offset), which every loadable object has even when its section
headers are stripped. Only the few kilobytes it needs are read, never a whole 500 MB library.

Standard library only (the build runs it with the project's Python 3.11).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

_MAGIC = b"\x7fELF"
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ, _DT_SONAME, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 10, 14, 15, 29


class ElfError(ValueError):
    """A file that starts like an ELF object but cannot be read as one this build supports."""


@dataclass(frozen=True)
class Dynamic:
    """The loader-relevant part of an ELF object's dynamic section (empty for a static binary)."""

    needed: tuple[str, ...] = ()
    runpath: tuple[str, ...] = ()  # RUNPATH, or RPATH when there is no RUNPATH (as ld.so uses them)
    soname: str | None = None


def is_elf(path: Path) -> bool:
    """Whether ``path`` is a regular file that starts with the ELF magic."""
    try:
        with path.open("rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


def read_dynamic(path: Path) -> Dynamic:
    """The DT_NEEDED names, search path and SONAME of a 64-bit little-endian ELF object."""
    with path.open("rb") as f:
        ident = f.read(64)
        if ident[:4] != _MAGIC:
            raise ElfError(f"{path}: not an ELF file")
        if ident[4] != 2 or ident[5] != 1:
            raise ElfError(f"{path}: only 64-bit little-endian ELF is supported (x86-64 images)")
        (phoff,) = struct.unpack_from("<Q", ident, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", ident, 0x36)
        f.seek(phoff)
        headers = f.read(phentsize * phnum)
        loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
        dynamic: tuple[int, int] | None = None
        for i in range(phnum):
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
                "<IIQQQQ", headers, i * phentsize
            )
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            return Dynamic()
        f.seek(dynamic[0])
        raw = f.read(dynamic[1])
        entries: list[tuple[int, int]] = []
        for off in range(0, len(raw) - 15, 16):
            tag, value = struct.unpack_from("<qQ", raw, off)
            if tag == _DT_NULL:
                break
            entries.append((tag, value))
        tags = dict(entries)
        if _DT_STRTAB not in tags:
            raise ElfError(f"{path}: dynamic section without a string table")
        strtab = _file_offset(path, loads, tags[_DT_STRTAB])
        f.seek(strtab)
        strings = f.read(tags.get(_DT_STRSZ, 1 << 20))

    def string(index: int) -> str:
        end = strings.find(b"\0", index)
        return strings[index : end if end >= 0 else None].decode("utf-8", "surrogateescape")

    needed = tuple(string(v) for t, v in entries if t == _DT_NEEDED)
    runpath = [string(v) for t, v in entries if t == _DT_RUNPATH] or [
        string(v) for t, v in entries if t == _DT_RPATH
    ]
    soname = next((string(v) for t, v in entries if t == _DT_SONAME), None)
    dirs = tuple(d for entry in runpath for d in entry.split(":") if d)
    return Dynamic(needed=needed, runpath=dirs, soname=soname)


def _file_offset(path: Path, loads: list[tuple[int, int, int]], vaddr: int) -> int:
    for seg_vaddr, seg_offset, seg_size in loads:
        if seg_vaddr <= vaddr < seg_vaddr + seg_size:
            return vaddr - seg_vaddr + seg_offset
    raise ElfError(f"{path}: address {vaddr:#x} is in no loadable segment")


def expand_origin(directory: str, origin: str) -> str:
    """A RUNPATH entry with ``$ORIGIN``/``${ORIGIN}`` replaced by the object's own directory."""
    return directory.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
