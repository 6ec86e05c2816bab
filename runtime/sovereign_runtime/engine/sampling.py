"""Per-request sampling parameters: the one owner of every bound, checked at the edge so the hot loop can
trust them. A violated bound raises ``InvalidRequest`` naming the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .api import InvalidRequest
from .repetition import check_window

# Generous but finite: a client asking for more is almost certainly a bug.
MAX_TOKENS_LIMIT = 1 << 20
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
SEED_LIMIT = 2**63


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or -1) and ``top_p == 1`` disable those filters.
    ``logprobs=None`` returns none; ``logprobs=n`` returns the chosen token's log-probability plus the
    ``n`` most likely alternatives. Stop *strings* are the server's job (it sees the text).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    # End the request (finish_reason "error") once its last N tokens repeat a pattern of <= 8 tokens;
    # 0: off (engine/repetition.py).
    repetition_window: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_number("temperature", self.temperature, float)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            _bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _check_number("top_p", self.top_p, float)
        if not 0.0 < self.top_p <= 1.0:
            _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_number("top_k", self.top_k, int)
        if self.top_k < -1:
            _bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _check_number("max_tokens", self.max_tokens, int)
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            _bad("max_tokens", f"must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}")
        _check_number("min_tokens", self.min_tokens, int)
        if not 0 <= self.min_tokens <= self.max_tokens:
            _bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None:
            _check_number("seed", self.seed, int)
            if not 0 <= self.seed < SEED_LIMIT:
                _bad("seed", f"must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            _bad("stop_token_ids", f"must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            _bad("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, int)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                _bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        check_window(self.repetition_window)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_first_token(self) -> SamplingParams:
        """The parameters a remote prefill samples with: this request's first token, exactly as a unified
        run samples it (temperature, filters, seed, logprobs), and nothing after it.

        Stopping rules (``min_tokens``, stop ids, EOS) stay with the decode instance, which applies this
        request's own parameters to the first token it receives and to every later one.
        """
        return dataclasses.replace(self, max_tokens=1, min_tokens=0)


def _bad(name: str, rule: str) -> None:
    raise InvalidRequest(name, rule)


def _check_number(name: str, value: object, kind: type) -> None:
    # bool is an int subclass; reject it so `temperature=True` is a clear error, not 1.0.
    ok = isinstance(value, int | float) if kind is float else isinstance(value, int)
    if not ok or isinstance(value, bool):
        _bad(name, f"must be {'a number' if kind is float else 'an integer'}, got {value!r}")
