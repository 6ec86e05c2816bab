"""Constrained decoding: output that must match a JSON Schema (``response_format``), with xgrammar.

``Grammars`` compiles a schema once per engine vocabulary (xgrammar caches compiled grammars) and
hands each request its own ``GrammarMatcher``. Every step the sampler asks each constrained row's
matcher which tokens may come next and sets every other logit to -inf (``apply_grammar_masks``); the
engine then feeds the chosen token back (``accept``). Once the value is complete the matcher allows
only the tokenizer's stop tokens, so a request ends with ``finish_reason: "stop"`` on a valid value,
or with ``"length"`` when ``max_tokens`` cut it short (as OpenAI's API).

``response_format: {"type": "json_object"}`` is the schema ``{"type": "object"}``. xgrammar is
imported on first use: an engine that never sees a constrained request never loads it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .api import InvalidRequest

if TYPE_CHECKING:  # torch-free at import: the server's protocol layer reads the schema rules here
    import torch

    from ..tokenizer import Tokenizer

JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})
MAX_SCHEMA_BYTES = 64 * 1024
# Whitespace the grammar allows between two JSON tokens: enough for a newline and indentation five
# levels deep at two spaces, not for a model that drifts into whitespace until max_tokens.
MAX_WHITESPACE_RUN = 12
GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024


class Grammars:
    """Compiled grammars for one vocabulary; ``matcher(schema)`` starts a request's.

    Built cheaply at load; xgrammar and the vocabulary's token table are set up on the first
    constrained request (``compile``, which the async engine runs off the event loop)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from transformers import PreTrainedTokenizerFast

                # xgrammar reads the vocabulary and its byte encoding (byte-level BPE, byte fallback
                # or raw) from a transformers tokenizer; ours wraps the same tokenizer.json.
                info = xgrammar.TokenizerInfo.from_huggingface(
                    PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.hf),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                )
                # Bounded: every distinct schema a client sends stays cached otherwise.
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
            return self._compiler

    def compile(self, schema: str) -> Any:
        """The compiled grammar of ``schema`` (JSON text; xgrammar caches it); a schema xgrammar
        cannot compile is an ``InvalidRequest`` naming ``json_schema``."""
        compiler = self._xgrammar_compiler()
        try:
            return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE_RUN)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            text = str(exc).strip()
            message = text.splitlines()[0] if text else type(exc).__name__
            raise InvalidRequest(
                "json_schema", f"is not a JSON Schema this server can enforce: {message[:300]}"
            ) from None

    def matcher(self, schema: str) -> Any:
        """A fresh matcher for ``schema``: instant once ``compile`` has seen it."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(schema))

    def apply_masks(self, logits: torch.Tensor, matchers: Sequence[Any | None]) -> None:
        """Set, in place, every logit a row's matcher forbids to -inf (rows without one untouched)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows
        )


def accept(matcher: Any, token: int) -> bool:
    """Advance ``matcher`` past ``token``; False when the grammar does not allow it (never after a
    masked sample: that would be a bug, and the request fails rather than return invalid output)."""
    return bool(matcher.accept_token(token))


def check_schema(schema: object) -> str:
    """``schema`` itself when it is JSON text of an object within the size cap, else an
    ``InvalidRequest`` naming ``json_schema``."""
    if not isinstance(schema, str):
        raise InvalidRequest("json_schema", f"must be JSON text, got {type(schema).__name__}")
    if len(schema.encode("utf-8", "surrogatepass")) > MAX_SCHEMA_BYTES:
        raise InvalidRequest("json_schema", f"must be at most {MAX_SCHEMA_BYTES} bytes of JSON")
    try:
        parsed = json.loads(schema)
    except (ValueError, RecursionError):
        raise InvalidRequest("json_schema", "must be valid JSON") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("json_schema", f"must be a JSON object (a schema), got {type(parsed).__name__}")
    return schema
