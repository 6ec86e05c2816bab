"""The engine's torch-free contract with its callers: what a request gets back, the statistics snapshot,
and the error that names the request field it rejects.

The server imports these types (never guesses their shapes); ``SamplingParams`` (``sampling.py``) is the
other half of the contract, what a request asks for.
"""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequest(ValueError):
    """A request the engine refuses: the engine-side field at fault and the rule it breaks.

    ``param`` is a ``SamplingParams`` field (``"temperature"``, ``"max_tokens"``...) or ``"prompt"``; None
    when no single field is at fault. ``rule`` completes a sentence about the field (``"must be in [0, 2],
    got 3"``), so a caller that names the field otherwise (the server: the OpenAI parameter the client sent)
    words the error in its own terms without parsing this one's text.
    """

    def __init__(self, param: str | None, rule: str) -> None:
        super().__init__(rule if param is None else f"{param} {rule}")
        self.param = param
        self.rule = rule


class RequestFailed(RuntimeError):
    """The engine ended this request with an error that is not the client's: its logits turned non-finite
    (``kind`` ``"nonfinite_logits"``) or its inputs raised inside an engine step (``"step_exception"``).
    The other requests of the batch continue; the server answers this one with a 500."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the params.logprobs most likely (token_id, logprob), best first


@dataclass
class RequestOutput:
    """What one request gained in one engine step (a streaming delta), plus running totals and times."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None  # one per new token when params.logprobs is set
    finished: bool
    # "stop" (EOS or stop token), "length", "abort", or "error": the output repeated (repetition_window),
    # or, with ``error`` set, the request failed (AsyncEngine raises RequestFailed for it)
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0  # monotonic seconds, when the engine accepted the request
    first_token_time: float | None = None  # when the first output token was produced
    time: float = 0.0  # when this output was produced (ITL = difference between consecutive ones)
    error: RequestFailed | None = None  # why the engine failed the request (finish_reason "error")
    # Speculative decoding, this request's totals so far: verify steps, draft tokens proposed, accepted.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class SchedulerStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_waiting: int
    num_preemptions: int


@dataclass
class EngineStats(SchedulerStats):
    prefix_cache_hit_rate: float = 0.0
    prompt_tokens_total: int = 0  # prompt tokens run through the model (cache hits excluded)
    generation_tokens_total: int = 0
    num_blocks: int = 0
    block_size: int = 0
    # The output guard (engine/guard.py) and repetition detection.
    nonfinite_logits_total: int = 0
    precision_fallbacks_total: int = 0
    precision_fallbacks_recovered_total: int = 0
    isolated_exceptions_total: int = 0
    degenerate_outputs_total: int = 0
    # MTP speculative decoding (engine/speculative.py); all zero/False when it is off.
    spec_decode_requested: bool = False
    spec_decode_enabled: bool = False
    spec_decode_drafting: bool = False  # False while the adaptive switch holds drafting off
    spec_decode_num_draft_tokens: int = 0  # K, the draft length asked for
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_acceptance_rate: float = 0.0
    spec_decode_mean_accept_length: float = 0.0
