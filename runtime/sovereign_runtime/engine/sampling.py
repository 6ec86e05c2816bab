"""Per-request sampling parameters: the one owner of every bound, checked at the edge so the hot loop can
trust them. A violated bound raises ``InvalidRequest`` naming the field."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from .api import InvalidRequest
from .grammar import check_schema
from .repetition import check_window

# Generous but finite: a client asking for more is almost certainly a bug.
MAX_TOKENS_LIMIT = 1 << 20
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
# Past any vocabulary (a larger top_k filters nothing); bounded so no tensor op sees an int64 overflow.
MAX_TOP_K = 1 << 20
SEED_LIMIT = 2**63
# OpenAI's own bounds for logit_bias: at most 300 tokens, each biased by a number in [-100, 100].
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0  # OpenAI's bound for presence_penalty and frequency_penalty
MAX_REPETITION_PENALTY = 2.0
MAX_TOKEN_ID_DIGITS = 18  # far past any vocabulary; keeps int() of a hostile key cheap


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or -1) and ``top_p == 1`` disable those filters.
    ``logprobs=None`` returns none; ``logprobs=n`` returns the chosen token's log-probability plus the
    ``n`` most likely alternatives. Stop *strings* are the server's job (it sees the text).
    ``logit_bias`` maps token ids to a number in [-100, 100] added to that token's logit before anything
    else (temperature, filters, greedy argmax, logprobs): -100 effectively bans a token, +100 forces it.
    Keys may be integers or decimal strings (OpenAI's JSON form, and what a JSON round trip gives back);
    validation normalises them to ``dict[int, float]``. Ids are checked against the vocabulary by
    ``check_vocab``, which the engine calls (this class does not know the model).
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
    logit_bias: dict[int, float] = field(default_factory=dict)
    # OpenAI's penalties, each in [-2, 2]: every token already in the output has its logit lowered by
    # presence_penalty once and by frequency_penalty per time it occurs (after logit_bias, before
    # temperature and the filters). 0: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's and transformers' multiplicative penalty, in (0, 2]: every token of the prompt or the
    # output has a positive logit divided by it and a negative one multiplied (applied before the two
    # above). 1: off.
    repetition_penalty: float = 1.0
    # vLLM's min-p filter, in [0, 1]: after temperature, tokens less likely than min_p times the most
    # likely one are dropped. 0: off.
    min_p: float = 0.0
    # A JSON Schema (JSON text) the output must match, enforced token by token (engine/grammar.py);
    # the server sets it from ``response_format``. None: unconstrained.
    json_schema: str | None = None

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
        if not -1 <= self.top_k <= MAX_TOP_K:
            _bad("top_k", f"must be -1, 0 (disabled) or an integer in [1, {MAX_TOP_K}], got {self.top_k}")
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value, float)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                _bad(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty, float)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            _bad(
                "repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
            )
        _check_number("min_p", self.min_p, float)
        if not 0.0 <= self.min_p <= 1.0:
            _bad("min_p", f"must be in [0, 1], got {self.min_p}")
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.json_schema is not None:
            self.json_schema = check_schema(self.json_schema)
            if self.ignore_eos:
                # A complete value allows only the stop tokens: ignoring them would have nothing left.
                _bad("json_schema", "cannot be combined with ignore_eos")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a ``logit_bias`` token id outside the model's vocabulary ``[0, vocab_size)``."""
        outside = [t for t in self.logit_bias if t >= vocab_size]
        if outside:
            _bad("logit_bias", f"token ids must be in [0, {vocab_size}), got {outside[0]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the tokens so far change the next token's logits (never drafted: each position
        of a verify would need the drafts before it counted)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_first_token(self) -> SamplingParams:
        """The parameters a remote prefill samples with: this request's first token, exactly as a unified
        run samples it (temperature, filters, seed, logprobs), and nothing after it.

        Stopping rules (``min_tokens``, stop ids, EOS) stay with the decode instance, which applies this
        request's own parameters to the first token it receives and to every later one.
        """
        return dataclasses.replace(self, max_tokens=1, min_tokens=0)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves these fields out samples with: OpenAI's defaults, or the model's
    own recommendation from its ``generation_config.json`` (``read_generation_config``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def changed(self) -> dict[str, float]:
        """The fields that differ from OpenAI's defaults (what a log line should say)."""
        base = SamplingDefaults()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        }


# The generation_config.json keys a request's defaults come from, as vLLM reads them (its
# --generation-config auto); do_sample and max_new_tokens are not among them.
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(model_dir: Path) -> SamplingDefaults:
    """The sampling defaults ``model_dir/generation_config.json`` recommends (OpenAI's where it has
    none, or no such file). A value out of range is a ValueError naming the file and the key."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a JSON object")
    found = {key: raw[key] for key in GENERATION_CONFIG_KEYS if raw.get(key) is not None}
    try:
        checked = SamplingParams(**found)  # the same bounds a request's own values meet
    except InvalidRequest as exc:
        raise ValueError(f"{path}: {exc}") from None
    return SamplingDefaults(**{key: getattr(checked, key) for key in found})


def _normalise_logit_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        _bad("logit_bias", f"must be an object mapping token ids to biases, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        _bad("logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_id(key)
        if token in out:
            _bad("logit_bias", f"keys must be distinct token ids, got {token} twice")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            _bad("logit_bias", f"values must be finite numbers, got {value!r} for token {token}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            _bad(
                "logit_bias",
                f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r} for token {token}",
            )
        out[token] = float(value)
    return out


def _token_id(key: object) -> int:
    # JSON object keys are strings: OpenAI sends {"15": -100}; a Python caller may pass ints.
    if isinstance(key, int) and not isinstance(key, bool):
        token = key
    elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS:
        token = int(key)
    else:
        _bad(
            "logit_bias",
            f"keys must be non-negative integer token ids of at most {MAX_TOKEN_ID_DIGITS} digits, got {key!r}",
        )
    if token < 0:
        _bad("logit_bias", f"keys must be non-negative integer token ids, got {key!r}")
    return token


def _bad(name: str, rule: str) -> NoReturn:
    raise InvalidRequest(name, rule)


def _check_number(name: str, value: object, kind: type) -> None:
    # bool is an int subclass; reject it so `temperature=True` is a clear error, not 1.0.
    ok = isinstance(value, int | float) if kind is float else isinstance(value, int)
    if not ok or isinstance(value, bool):
        _bad(name, f"must be {'a number' if kind is float else 'an integer'}, got {value!r}")
