"""Built-in models shipped as package data, addressed as ``builtin:NAME`` on the runtime CLI.

``sovereign-tiny`` is a small DeepSeek-V3-architecture checkpoint (MLA, MoE, YaRN, one MTP layer) in HF
format, trained by :mod:`sovereign_runtime.builtin.train` on the exact-answer task in
:mod:`sovereign_runtime.builtin.tasks`.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

BUILTIN_MODELS: dict[str, str] = {
    "sovereign-tiny": "sovereign-tiny",
}
PREFIX = "builtin:"


def builtin_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


def resolve_builtin(name: str) -> Path:
    """Folder of the packaged checkpoint for ``name`` (``sovereign-tiny`` or ``builtin:sovereign-tiny``).

    Raises ``ValueError`` naming the valid built-in models when ``name`` is unknown, and
    ``FileNotFoundError`` when the package was installed without its data files.
    """
    key = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    if key not in BUILTIN_MODELS:
        valid = ", ".join(f"{PREFIX}{n}" for n in builtin_names())
        raise ValueError(f"unknown built-in model {name!r}; valid built-in models: {valid}")
    path = _HERE / BUILTIN_MODELS[key]
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"built-in model {key!r} is missing its checkpoint files under {path}; "
            "reinstall the package with its package data, or regenerate it with "
            f"`python -m sovereign_runtime.builtin.train --out {path}`"
        )
    return path


# The runtime CLI looks the resolver up as ``builtin.resolve``.
resolve = resolve_builtin
