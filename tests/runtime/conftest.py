"""Shared fixtures for runtime tests: tiny DeepSeek-V3 checkpoints written once per session."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import write_tiny_checkpoint

# The machine is shared and loaded: one thread is fastest for these tiny models.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(**options) -> Path`` of a checkpoint written by ``write_tiny_checkpoint``; cached per options."""
    cache: dict[tuple[tuple[str, Any], ...], Path] = {}

    def factory(**options: Any) -> Path:
        key = tuple(sorted(options.items()))
        if key not in cache:
            directory = tmp_path_factory.mktemp("tiny-v3")
            cache[key] = write_tiny_checkpoint(directory, **options)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    """The default tiny checkpoint: q_lora_rank set, nonzero router bias, an MTP layer, fp32."""
    return tiny_checkpoint_factory()


@pytest.fixture(scope="session")
def tiny_fp8_checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    """The default tiny checkpoint with its linear weights FP8 block-quantised (128×128 blocks)."""
    return tiny_checkpoint_factory(fp8=True)
