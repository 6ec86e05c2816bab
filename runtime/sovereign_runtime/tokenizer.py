"""Text side of serving: HF tokenizer files, chat templates, streaming detokenization, stop strings and
the ``<think>`` reasoning parser.

Everything here is pure Python over the ``tokenizers`` library; the server composes these pieces per
request: token ids -> ``IncrementalDetokenizer`` -> ``StopStringMatcher`` -> ``ReasoningParser``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

THINK_START = "<think>"
THINK_END = "</think>"
_REPLACEMENT = "\ufffd"
# What the server passes to every chat template (HF's names; ``apply_chat_template`` and
# ``compile_chat_template``): a request's chat_template_kwargs cannot set them.
TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "pad_token",
        "raise_exception",
        "strftime_now",
    }
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render."""


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as serialised AddedToken dicts.
    if value is None:
        return None
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    # HF's tojson keeps non-ASCII characters as they are (jinja's default escapes HTML characters).
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The environment chat templates run in, the way HF transformers sets it up: sandboxed,
    trim/lstrip blocks, loop controls, its ``tojson`` and globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way HF transformers does."""
    return _template_environment().from_string(source)


@dataclass
class Tokenizer:
    """An HF ``tokenizer.json`` plus the parts of ``tokenizer_config.json`` serving needs."""

    hf: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    add_bos_token: bool | None = None
    # Added tokens flagged special; dropped from decoded text except the reasoning markers.
    special_ids: frozenset[int] = frozenset()
    _template: jinja2.Template | None = field(default=None, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        hf = HFTokenizer.from_file(str(tok_file))
        config: dict[str, Any] = {}
        cfg_file = root / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):
            # Multiple named templates: HF picks the one called "default".
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {
            tid
            for tid, added in hf.get_added_tokens_decoder().items()
            if added.special and added.content not in (THINK_START, THINK_END)
        }
        add_bos = config.get("add_bos_token")
        return cls(
            hf=hf,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            chat_template=template if isinstance(template, str) else None,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            special_ids=frozenset(special),
        )

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with another chat template (``serve --chat-template``)."""
        return dataclasses.replace(self, chat_template=source, _template=None)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)
        # Some tokenizer.json files carry no post-processor but the config asks for a BOS token.
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(self._visible(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        return self.hf.id_to_token(token_id) or ""

    def _visible(self, ids: Iterable[int], hidden: frozenset[int] | None = None) -> list[int]:
        """``ids`` without the ``hidden`` tokens (default: the special ones)."""
        hidden = self.special_ids if hidden is None else hidden
        return [i for i in ids if i not in hidden]

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (``tools``, ``messages``, ...)."""
        if self.chat_template is None:
            return frozenset()
        try:
            parsed = _template_environment().parse(self.chat_template)
            return frozenset(jinja2.meta.find_undeclared_variables(parsed))
        except jinja2.TemplateError:
            return frozenset()  # rendering reports the template's error as a 400 of its own

    @property
    def template_renders_tools(self) -> bool:
        """The template writes the request's ``tools`` into the prompt (DeepSeek-V3's own does not)."""
        return "tools" in self.template_variables

    @property
    def template_renders_tool_calls(self) -> bool:
        """The template writes an assistant turn's ``tool_calls`` (read as a message field, so by name)."""
        return self.chat_template is not None and "tool_calls" in self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer has no chat_template; use /v1/completions")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                **extra,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            # A conversation the template cannot render (a missing or null field it expects) is the
            # client's to fix, never a server error.
            raise ChatTemplateError(
                f"chat template failed to render: {exc.__class__.__name__}: {exc}"
            ) from exc

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 length of the longest vocabulary entry: no token covers more bytes of text than this."""
        return max((len(t.encode("utf-8")) for t in self.hf.get_vocab(with_added_tokens=True)), default=1)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """Render and tokenise a conversation; the template already wrote BOS, so add no special tokens.
        ``tools`` (OpenAI's tool objects) reach the template as HF's ``tools`` variable;
        ``template_kwargs`` are more variables (the request's ``chat_template_kwargs``)."""
        extra = dict(template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return text, self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (from ``prefix`` to the end) and compares it with the window's already-emitted
    part, so byte-level BPE tokens that only form a character together never produce U+FFFD in a delta.
    """

    # Tokens kept in front of the unread ones so merges across the boundary decode the same way.
    _CONTEXT = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), keep: frozenset[int] = frozenset()
    ) -> None:
        """``keep``: special tokens to write into the text (a tool-call parser reads its markers)."""
        self._tok = tokenizer
        self._hidden = tokenizer.special_ids - keep if keep else tokenizer.special_ids
        visible = tokenizer._visible(prompt_ids, self._hidden)
        self._ids: list[int] = visible[-self._CONTEXT :]
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def add(self, new_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        added = self._tok._visible(new_ids, self._hidden)
        if not added:
            return ""
        self._ids.extend(added)
        prefix_text = self._tok.hf.decode(self._ids[self._prefix : self._read], skip_special_tokens=False)
        full_text = self._tok.hf.decode(self._ids[self._prefix :], skip_special_tokens=False)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            # An incomplete multi-byte character: wait for the next token.
            return ""
        delta = full_text[len(prefix_text) :]
        # The tokens just emitted become the context of the next window.
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit whatever is left, even an incomplete character."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._tok.hf.decode(self._ids[self._prefix : self._read], skip_special_tokens=False)
        full_text = self._tok.hf.decode(self._ids[self._prefix :], skip_special_tokens=False)
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._read = len(self._ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that might start one.

    ``feed`` returns the text safe to emit and whether a stop string was hit; on a hit the stop string
    and everything after it are dropped (OpenAI semantics).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        buf = self._pending + delta
        hit_at, hit = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (hit_at == -1 or i < hit_at):
                hit_at, hit = i, s
        if hit is not None:
            self.stopped, self.matched, self._pending = True, hit, ""
            return buf[:hit_at]
        keep = partial_suffix(buf, self.stops)
        self._pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out


class ReasoningParser:
    """Splits streamed text into reasoning (inside ``<think>…</think>``) and answer content.

    ``started_in_reasoning`` is true when the prompt itself ends with ``<think>`` (templates that open the
    trace for the model). A leading ``<think>`` in the output opens it too. Tags are never emitted, and a
    tag split across deltas is recognised.
    """

    def __init__(self, started_in_reasoning: bool = False) -> None:
        self._in_reasoning = started_in_reasoning
        self._seen_end = False
        self._at_start = not started_in_reasoning
        self._strip_next = False
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """Return ``(reasoning_delta, content_delta)``."""
        buf = self._pending + delta
        self._pending = ""
        reasoning, content = [], []
        while buf:
            if self._at_start:
                stripped = buf.lstrip()
                if not stripped:
                    self._pending = buf
                    break
                if stripped.startswith(THINK_START):
                    self._in_reasoning, self._at_start = True, False
                    buf = stripped[len(THINK_START) :]
                    continue
                if THINK_START.startswith(stripped):
                    self._pending = buf
                    break
                self._at_start = False
                continue
            if self._in_reasoning:
                i = buf.find(THINK_END)
                if i != -1:
                    reasoning.append(buf[:i])
                    buf = buf[i + len(THINK_END) :]
                    self._in_reasoning, self._seen_end = False, True
                    # The answer usually starts after a newline; drop leading whitespace once.
                    buf = buf.lstrip("\n")
                    if not buf:
                        self._strip_next = True
                    continue
                keep = partial_suffix(buf, (THINK_END,))
                reasoning.append(buf[: len(buf) - keep])
                self._pending = buf[len(buf) - keep :]
                break
            if self._strip_next:
                buf = buf.lstrip("\n")
                self._strip_next = False
                if not buf:
                    continue
            content.append(buf)
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        if self._in_reasoning:
            return rest, ""
        return "", rest

    @staticmethod
    def split(text: str, started_in_reasoning: bool = False) -> tuple[str | None, str]:
        """Non-streaming form: ``(reasoning or None, content)``."""
        parser = ReasoningParser(started_in_reasoning)
        r1, c1 = parser.feed(text)
        r2, c2 = parser.flush()
        reasoning = r1 + r2
        saw = started_in_reasoning or parser._seen_end or parser._in_reasoning or bool(reasoning)
        return (reasoning if saw else None), c1 + c2


def partial_suffix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``markers``: text a
    streaming parser holds back, since the next delta may complete the marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buf)), best, -1):
            if buf.endswith(marker[:n]):
                best = n
                break
    return best
