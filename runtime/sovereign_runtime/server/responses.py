"""OpenAI response bodies: pure functions from what a request produced to the JSON the client reads.

The handlers in ``app.py`` collect ``Step``s from the engine and write; everything about the shape of a
chat completion, a text completion, their streamed chunks, usage and logprobs is here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..engine.api import TokenLogprob
from ..tokenizer import Tokenizer
from .generation import Step

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Envelope:
    """What every body of one response carries: its id, object type, creation time and model."""

    id: str
    object: str  # "chat.completion", "chat.completion.chunk", "text_completion"
    created: int
    model: str

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def sse(data: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def usage(finals: Iterable[Step], choices_per_prompt: int = 1) -> dict[str, Any]:
    """Token counts over the last ``Step`` of each choice of one response, in prompt order; a prompt's
    ``n`` choices count its tokens once, as OpenAI's usage does."""
    steps = list(finals)
    firsts = steps[::choices_per_prompt]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in steps)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
    }
    verify = sum(s.spec_verify_steps for s in steps)
    if verify:
        # Speculative decoding (an extension): draft tokens verified and kept, and tokens per verify
        # step (SGLang's accept length; 1.0 when no draft token was kept).
        accepted = sum(s.spec_accepted_tokens for s in steps)
        body["speculative_decoding"] = {
            "draft_tokens": sum(s.spec_draft_tokens for s in steps),
            "accepted_tokens": accepted,
            "verify_steps": verify,
            "accept_length": round(1.0 + accepted / verify, 4),
        }
    return body


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer, lps: list[TokenLogprob]) -> dict[str, Any] | None:
    """A chat choice's ``logprobs``: None when the request asked for none."""
    if not lps:
        return None
    content = []
    for lp in lps:
        entry = _token_entry(tokenizer, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def chat_message_choice(
    content: str | None,
    reasoning: str | None,
    logprobs: dict[str, Any] | None,
    finish: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_delta_choice(
    delta: dict[str, Any],
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def completion_choice(
    tokenizer: Tokenizer, index: int, text: str, lps: list[TokenLogprob], finish: str | None
) -> dict[str, Any]:
    logprobs = None
    if lps:
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for lp in lps:
            tok = tokenizer.decode([lp.token_id])
            tokens.append(tok)
            token_lps.append(lp.logprob)
            tops.append({tokenizer.decode([t]): v for t, v in lp.top})
            offsets.append(offset)
            offset += len(tok)
        logprobs = {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
