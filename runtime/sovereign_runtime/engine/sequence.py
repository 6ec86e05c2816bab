"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .radix_cache import RadixNode
from .repetition import RepetitionDetector
from .sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is in this sequence's blocks (cached prefix + everything computed so far).
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Deepest radix node this sequence reuses (locked while held), and how many prompt tokens the cache
    # supplied at first admission (reported as usage.cached_tokens).
    cache_node: RadixNode | None = None
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Set when params.repetition_window > 0: follows the output to end a degenerate one.
    repetition: RepetitionDetector | None = None
    # Set when params.json_schema is: the request's xgrammar matcher (engine/grammar.py).
    grammar: Any | None = None
    # Speculative decoding (engine/speculative.py): tokens the MTP layer proposes after the last token,
    # verified by the next step; and this request's totals (reported in its usage).
    draft: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_running(self) -> bool:
        return self.status is SequenceStatus.RUNNING

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
