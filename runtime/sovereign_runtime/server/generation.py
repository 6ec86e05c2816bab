"""One request through the engine: detokenize, match stop strings, time it, abort on early exit."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from .metrics import ServerMetrics
from .protocol import APIError
from .state import EngineLike

TopLogprobs = list[tuple[int, float]]


@dataclass
class Step:
    """What one engine output means for the client."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, TopLogprobs] | None] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def normalize_logprob(entry: Any) -> tuple[float, TopLogprobs] | None:
    """Accept the engine's per-token logprob in any of its plausible shapes."""
    if entry is None:
        return None
    if isinstance(entry, int | float):
        return float(entry), []
    if isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], int | float):
        top = entry[1] or []
        if isinstance(top, dict):
            top = list(top.items())
        return float(entry[0]), [(int(t), float(lp)) for t, lp in top]
    lp = getattr(entry, "logprob", None)
    if lp is not None:
        top = getattr(entry, "top", None) or getattr(entry, "top_logprobs", None) or []
        if isinstance(top, dict):
            top = list(top.items())
        return float(lp), [(int(t), float(v)) for t, v in top]
    return None


async def _aclose(gen: Any) -> None:
    close = getattr(gen, "aclose", None)
    if close is not None:
        await close()


async def _user_errors(gen: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The engine rejects requests it cannot serve (e.g. larger than the KV pool) with ValueError."""
    it = aiter(gen)
    while True:
        try:
            out = await anext(it)
        except StopAsyncIteration:
            return
        except ValueError as exc:
            raise APIError(str(exc), code="invalid_value") from None
        yield out


async def run_request(
    engine: EngineLike,
    tokenizer: Tokenizer,
    metrics: ServerMetrics,
    prompt_ids: Sequence[int],
    params: Any,
    stops: Sequence[str],
    request_id: str,
) -> AsyncIterator[Step]:
    """Yield one ``Step`` per engine output; the last has ``finish_reason`` set.

    Leaving early (client gone, stop string, cancellation) closes the engine's iterator, which aborts the
    request and frees its KV blocks at once.
    """
    arrival = time.monotonic()
    last_token_at: float | None = None
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    matcher = StopStringMatcher(stops)
    prompt_tokens, completion_tokens, cached_tokens = len(prompt_ids), 0, 0
    finish: str | None = None
    gen = engine.generate(list(prompt_ids), params, request_id=request_id)
    try:
        async for out in _user_errors(gen):
            now = time.monotonic()
            new_ids = list(out.new_token_ids or [])
            if new_ids:
                if last_token_at is None:
                    metrics.ttft.observe(now - arrival)
                else:
                    metrics.observe_token_gap(now - last_token_at, len(new_ids))
                last_token_at = now
            prompt_tokens = int(getattr(out, "prompt_tokens", None) or prompt_tokens)
            completion_tokens = int(
                getattr(out, "completion_tokens", None) or (completion_tokens + len(new_ids))
            )
            cached_tokens = int(getattr(out, "cached_tokens", None) or cached_tokens)
            text = detok.add(new_ids)
            if out.finished:
                text += detok.flush()
            text = matcher.feed(text)
            if matcher.stopped:
                finish = "stop"
            elif out.finished:
                text += matcher.flush()
                finish = out.finish_reason or "stop"
            raw_lps = list(getattr(out, "new_logprobs", None) or [])
            step = Step(
                text=text,
                token_ids=new_ids,
                logprobs=[normalize_logprob(x) for x in raw_lps],
                finish_reason=finish,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=cached_tokens,
            )
            yield step
            if finish is not None:
                break
    finally:
        # Closing before the engine finished aborts the request (stop string, disconnect, cancellation).
        await _aclose(gen)
        metrics.observe_finish(
            finish or "abort", prompt_tokens, completion_tokens, time.monotonic() - arrival
        )
