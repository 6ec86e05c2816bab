"""The server's edge: what a request body must be before anything expensive looks at it.

Pure functions, no HTTP: the body parsed with its failures as 400s (too deep, not JSON, lone
surrogates), and a bound on a prompt's length that its UTF-8 size alone proves, so a 16 MB prompt is
refused before the chat template and the tokenizer ever see it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .protocol import APIError

# Bodies above this are parsed on a worker thread so the event loop keeps answering /health.
PARSE_INLINE_BYTES = 256 * 1024
# A normalizer may fold several input bytes into one character of a token (NFKC): a margin on top of
# the longest token, so the bound below never refuses a prompt that would fit.
NORMALIZATION_MARGIN = 4
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}|\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body; an APIError (400) naming what is wrong with it otherwise."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise APIError("the JSON body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, over-long integers, bad bytes
        raise APIError(f"could not parse the JSON body: {exc}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
        raise APIError(
            "the JSON body contains a lone UTF-16 surrogate (e.g. \\ud800): strings must be valid Unicode",
            code="invalid_json",
        )
    return value


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def text_bytes(texts: list[str | None]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts if t)


def check_prompt_size(num_bytes: int, max_model_len: int, max_token_bytes: int, param: str) -> None:
    """Refuse a prompt whose UTF-8 size alone proves it has more tokens than the context holds."""
    limit = max_model_len * max_token_bytes * NORMALIZATION_MARGIN
    if num_bytes > limit:
        raise APIError(
            f"the prompt is {num_bytes} bytes, more than this model's context of {max_model_len} tokens"
            f" can hold (at most {limit} bytes)",
            param=param,
            code="context_length_exceeded",
        )
