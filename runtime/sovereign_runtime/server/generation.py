"""One request through the engine: detokenize, match stop strings, time it, abort on early exit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

from ..engine.api import InvalidRequest, RequestFailed, RequestOutput, TokenLogprob
from ..engine.sampling import SamplingParams
from ..tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from .metrics import ServerMetrics
from .protocol import APIError, request_error
from .state import EngineLike


@dataclass
class Step:
    """What one engine output means for the client."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when logprobs were asked
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Speculative decoding, the request's totals so far (engine/speculative.py); 0 when it is off.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class Outcome:
    """A whole request's output, for an answer that is not streamed."""

    text: str
    logprobs: list[TokenLogprob]
    last: Step  # the final step: finish reason and token counts
    token_ids: list[int] = field(default_factory=list)


async def collect(steps: AsyncIterator[Step]) -> Outcome:
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    token_ids: list[int] = []
    last = None
    async for step in steps:
        text.append(step.text)
        logprobs.extend(step.logprobs)
        token_ids.extend(step.token_ids)
        last = step
    if last is None:
        raise RuntimeError("the engine ended a request without a final output")
    return Outcome("".join(text), logprobs, last, token_ids)


async def merged(streams: Sequence[AsyncIterator[Step]]) -> AsyncIterator[tuple[int, Step]]:
    """The steps of several requests as they arrive, each with its request's index (``n`` choices, a list
    of prompts). An error in one is raised once all have ended; closing this stops them all."""
    if len(streams) == 1:
        async for step in streams[0]:
            yield 0, step
        return
    queue: asyncio.Queue[tuple[int, Step | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Step]) -> None:
        try:
            async for step in stream:
                await queue.put((i, step))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, step = await queue.get()
            if step is None:
                remaining -= 1
                continue
            yield i, step
        for task in tasks:
            task.result()  # surface an engine error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _user_errors(
    gen: AsyncIterator[RequestOutput],
    param_names: Mapping[str, str],
    timeout_s: float | None = None,
    arrival: float = 0.0,
) -> AsyncIterator[RequestOutput]:
    """The engine refuses requests it cannot serve (e.g. larger than the KV pool): a 400 naming the field.
    With ``timeout_s``, a request not finished that long after ``arrival`` ends with ``_TimedOut``."""
    it = aiter(gen)
    while True:
        try:
            if timeout_s is None:
                out = await anext(it)
            else:
                # Cancelling the engine's iterator aborts the request and frees its blocks.
                left = max(0.0, arrival + timeout_s - time.monotonic())
                out = await asyncio.wait_for(anext(it), left)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _TimedOut(timeout_s or 0.0) from None
        except InvalidRequest as exc:
            raise request_error(exc, param_names) from None
        except RequestFailed as exc:
            # Not the client's fault (non-finite logits, an engine-step exception): a 500 naming why, in
            # the body or as the stream's error event; never a token sampled from it.
            raise _Failed(exc) from None
        yield out


class _Failed(APIError):
    """The engine failed this request; ``run_request`` records it as finished with ``error``."""

    def __init__(self, exc: RequestFailed) -> None:
        super().__init__(
            f"the request failed in the engine: {exc}", status=500, type="internal_error", code=exc.kind
        )


class _TimedOut(APIError):
    """The request's deadline passed before its last token (``request_timeout``/``--request-timeout``)."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(
            f"the request did not finish within its deadline of {limit_s:g} s ('request_timeout' or the"
            " server's --request-timeout); it was aborted",
            status=408,
            code="request_timeout",
        )


async def run_request(
    engine: EngineLike,
    tokenizer: Tokenizer,
    metrics: ServerMetrics,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stops: Sequence[str],
    request_id: str,
    param_names: Mapping[str, str],
    timeout_s: float | None = None,
    keep_ids: frozenset[int] = frozenset(),
) -> AsyncIterator[Step]:
    """Yield one ``Step`` per engine output; the last has ``finish_reason`` set.

    Leaving early (client gone, stop string, cancellation) closes the engine's iterator, which aborts the
    request and frees its KV blocks at once. ``param_names`` renames a refused engine field to the
    client's parameter; ``keep_ids`` are special tokens written into the text (tool-call markers).
    """
    arrival = time.monotonic()
    last_token_at: float | None = None
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, keep_ids)
    matcher = StopStringMatcher(stops)
    prompt_tokens, completion_tokens, cached_tokens = len(prompt_ids), 0, 0
    finish: str | None = None
    gen = engine.generate(list(prompt_ids), params, request_id=request_id)
    try:
        async for out in _user_errors(gen, param_names, timeout_s, arrival):
            now = time.monotonic()
            new_ids = out.new_token_ids
            if new_ids:
                if last_token_at is None:
                    metrics.ttft.observe(now - arrival)
                else:
                    metrics.observe_token_gap(now - last_token_at, len(new_ids))
                last_token_at = now
            prompt_tokens, completion_tokens = out.prompt_tokens, out.completion_tokens
            cached_tokens = out.cached_tokens
            logprobs = out.new_logprobs or []
            if len(new_ids) > 1 and stops:
                # Several tokens in one step (a verified draft): match stop strings token by token, so a
                # stop ends the output at the token that completed it, as one token per step would.
                text, kept = _feed_until_stop(detok, matcher, new_ids)
                completion_tokens -= len(new_ids) - kept
                new_ids, logprobs = new_ids[:kept], logprobs[:kept]
                if not matcher.stopped and out.finished:
                    text += matcher.feed(detok.flush())
            else:
                text = detok.add(new_ids)
                if out.finished:
                    text += detok.flush()
                text = matcher.feed(text)
            if matcher.stopped:
                finish = "stop"
            elif out.finished:
                text += matcher.flush()
                finish = out.finish_reason or "stop"
            step = Step(
                text=text,
                token_ids=new_ids,
                logprobs=logprobs,
                finish_reason=finish,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=cached_tokens,
                spec_verify_steps=out.spec_verify_steps,
                spec_draft_tokens=out.spec_draft_tokens,
                spec_accepted_tokens=out.spec_accepted_tokens,
            )
            yield step
            if finish is not None:
                break
    except (_Failed, _TimedOut):
        finish = "error"
        raise
    finally:
        # Closing before the engine finished aborts the request (stop string, disconnect, cancellation).
        await gen.aclose()
        metrics.observe_finish(
            finish or "abort", prompt_tokens, completion_tokens, time.monotonic() - arrival
        )


def _feed_until_stop(
    detok: IncrementalDetokenizer, matcher: StopStringMatcher, token_ids: list[int]
) -> tuple[str, int]:
    """Detokenize and stop-match ``token_ids`` one at a time; the text released and how many tokens it
    took (all, or up to the one that completed a stop string)."""
    parts: list[str] = []
    kept = 0
    for token in token_ids:
        parts.append(matcher.feed(detok.add([token])))
        kept += 1
        if matcher.stopped:
            break
    return "".join(parts), kept
