"""Tool calling: the model's tool-call markup parsed into OpenAI ``tool_calls``, and the schemas that force
a call (``tool_choice: "required"`` or a named function) through constrained decoding.

Pure functions and classes over text. DeepSeek's checkpoints write a call between marker tokens, in two
layouts that share the markers:

- V3 / R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``
- V3.1 and later: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``

all inside ``<｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜>``. ``ToolCallParser`` reads either from streamed
text (the server keeps the marker tokens in the text of requests that parse tools) and hands back a call
as soon as its end marker arrives; text before the calls stays the message's content, and markup it
cannot read is returned as content too, never dropped.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..tokenizer import partial_suffix


@dataclass(frozen=True)
class ToolCallFormat:
    """The marker strings one model family writes around its tool calls."""

    calls_begin: str
    calls_end: str
    call_begin: str
    call_end: str
    separator: str

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.calls_begin, self.calls_end, self.call_begin, self.call_end, self.separator)

    def marker_ids(self, token_to_id: Callable[[str], int | None]) -> frozenset[int] | None:
        """The markers' token ids in a vocabulary, or None when it lacks any of them."""
        ids = [token_to_id(m) for m in self.markers]
        return None if any(i is None for i in ids) else frozenset(i for i in ids if i is not None)


DEEPSEEK = ToolCallFormat(
    calls_begin="<｜tool▁calls▁begin｜>",
    calls_end="<｜tool▁calls▁end｜>",
    call_begin="<｜tool▁call▁begin｜>",
    call_end="<｜tool▁call▁end｜>",
    separator="<｜tool▁sep｜>",
)
FORMATS = (DEEPSEEK,)


def detect_format(
    token_to_id: Callable[[str], int | None],
) -> tuple[ToolCallFormat, frozenset[int]] | None:
    """The tool-call format whose markers are all tokens of this vocabulary, with their ids."""
    for fmt in FORMATS:
        ids = fmt.marker_ids(token_to_id)
        if ids is not None:
            return fmt, ids
    return None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_call_deltas(calls: Sequence[ToolCall], first_index: int) -> list[dict[str, Any]]:
    """Streamed ``delta.tool_calls`` entries: each call whole in one entry, numbered from ``first_index``."""
    return [{"index": first_index + i, **call.body()} for i, call in enumerate(calls)]


def _strip_fence(text: str) -> str:
    """ARGS out of V3's ```json fence (left as it is when there is no fence)."""
    body = text.strip()
    if body.startswith("```"):
        newline = body.find("\n")
        body = body[newline + 1 :] if newline != -1 else ""
        if body.rstrip().endswith("```"):
            body = body.rstrip()[:-3]
    return body.strip()


def parse_call(
    segment: str, fmt: ToolCallFormat, make_id: Callable[[], str] = new_call_id
) -> ToolCall | None:
    """One call's text between ``call_begin`` and ``call_end`` (markers included or not); None when it
    is not a call in either layout."""
    text = segment.replace(fmt.calls_begin, "").replace(fmt.call_begin, "").strip()
    head, sep, tail = text.partition(fmt.separator)
    if not sep:
        return None
    head = head.strip()
    if head == "function" and "\n" in tail.lstrip(" "):
        # V3 / R1: the type before the separator, then the name on its own line and fenced JSON.
        name, _, args = tail.lstrip(" ").partition("\n")
        name, arguments = name.strip(), _strip_fence(args)
    else:
        name, arguments = head, _strip_fence(tail)
    if not name or any(ch.isspace() for ch in name):
        return None
    return ToolCall(name=name, arguments=arguments, id=make_id())


class ToolCallParser:
    """Splits streamed content into plain text and the tool calls the model wrote.

    ``feed`` returns ``(content_delta, calls)``: text safe to show now (a possible marker's start is held
    back) and every call whose end marker has arrived. ``flush`` at the end returns what is left; an
    unfinished call (``max_tokens`` cut it) comes back as content, markup included, so nothing is lost.
    """

    def __init__(self, fmt: ToolCallFormat, make_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self._make_id = make_id
        self._buf = ""
        self._in_calls = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        fmt = self.fmt
        buf = self._buf + delta
        self._buf = ""
        content: list[str] = []
        calls: list[ToolCall] = []
        while buf:
            if not self._in_calls:
                starts = [i for i in (buf.find(fmt.calls_begin), buf.find(fmt.call_begin)) if i != -1]
                if not starts:
                    keep = partial_suffix(buf, (fmt.calls_begin, fmt.call_begin))
                    content.append(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    break
                at = min(starts)
                content.append(buf[:at])
                buf = buf[at:]
                self._in_calls = True
                continue
            end = buf.find(fmt.call_end)
            section_end = buf.find(fmt.calls_end)
            if section_end != -1 and (end == -1 or section_end < end):
                # The section closed: anything unread before it was not a call.
                rest = buf[:section_end].replace(fmt.calls_begin, "").strip()
                if rest:
                    content.append(buf[:section_end])
                buf = buf[section_end + len(fmt.calls_end) :]
                self._in_calls = False
                continue
            if end == -1:
                self._buf = buf
                break
            segment = buf[:end]
            call = parse_call(segment, fmt, self._make_id)
            if call is None:
                content.append(segment + fmt.call_end)
            else:
                calls.append(call)
            buf = buf[end + len(fmt.call_end) :]
        return "".join(content), calls

    def flush(self) -> str:
        """The text still held back: a partial marker or an unfinished call, as content."""
        rest, self._buf = self._buf, ""
        return rest

    @staticmethod
    def split(
        text: str, fmt: ToolCallFormat, make_id: Callable[[], str] = new_call_id
    ) -> tuple[str, list[ToolCall]]:
        """Non-streaming form: ``(content, calls)``."""
        parser = ToolCallParser(fmt, make_id)
        content, calls = parser.feed(text)
        return content + parser.flush(), calls


# ---- tool_choice "required" and a named function: constrained decoding ----------------------------------


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's argument schema; a function without ``parameters`` takes an object (OpenAI's reading)."""
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def named_call_schema(tool: dict[str, Any]) -> str:
    """``tool_choice: {"type": "function", ...}``: the output is that function's arguments."""
    return json.dumps(function_parameters(tool))


def required_calls_schema(tools: Sequence[dict[str, Any]], parallel: bool) -> str:
    """``tool_choice: "required"``: the output is a JSON list of ``{"name", "arguments"}`` calls (one when
    ``parallel_tool_calls`` is false), each naming one of ``tools`` with arguments matching its schema."""
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "const": t["function"]["name"]},
                    "arguments": function_parameters(t),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def calls_from_required(text: str, make_id: Callable[[], str] = new_call_id) -> list[ToolCall] | None:
    """The calls in a ``required`` answer; None when the text is not a complete list (``max_tokens``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in value
    ):
        return None
    return [
        ToolCall(name=c["name"], arguments=json.dumps(c["arguments"], ensure_ascii=False), id=make_id())
        for c in value
    ]


class ToolChoiceOutput:
    """One chat request's content after reasoning is split off, read for its ``tool_choice``.

    ``feed`` returns ``(content_delta, delta_entries)`` for a streamed chunk; ``finish`` returns what is
    left and the finish reason (``"tool_calls"`` when the model stopped after calling). ``calls`` holds
    the whole calls for an answer that is not streamed.

    - ``none``: content as it is.
    - ``auto``: the model's tool-call markup (``fmt``) becomes calls; each streams whole once its end
      marker arrives.
    - ``function`` (a named function): the constrained output is the arguments; they stream as they come,
      after one entry with the call's id and name (OpenAI's streamed shape).
    - ``required``: the constrained output is a JSON list of calls, read at the end (a list cut short by
      ``max_tokens`` comes back as content).
    """

    def __init__(
        self,
        mode: str,
        fmt: ToolCallFormat | None = None,
        function: str | None = None,
        make_id: Callable[[], str] = new_call_id,
    ) -> None:
        if mode == "auto" and fmt is None:
            raise ValueError("tool_choice 'auto' needs the model's tool-call format")
        if mode == "function" and not function:
            raise ValueError("a named tool_choice needs the function's name")
        self.mode = mode
        self.fmt = fmt
        self.function = function
        self._make_id = make_id
        self._parser = ToolCallParser(fmt, make_id) if mode == "auto" and fmt is not None else None
        self._text: list[str] = []  # function / required: the constrained output so far
        self._call_id = make_id() if mode == "function" else ""
        self.calls: list[ToolCall] = []

    def fresh(self) -> ToolChoiceOutput:
        """Another choice of the same request (``n``): the same reading, its own state and call ids."""
        return ToolChoiceOutput(self.mode, self.fmt, self.function, self._make_id)

    def feed(self, content: str) -> tuple[str, list[dict[str, Any]]]:
        if self._parser is not None:  # auto
            text, calls = self._parser.feed(content)
            first = len(self.calls)
            self.calls.extend(calls)
            return text, tool_call_deltas(calls, first)
        if self.mode == "function":
            entries: list[dict[str, Any]] = []
            if not self._text:
                entries.append(
                    {
                        "index": 0,
                        "id": self._call_id,
                        "type": "function",
                        "function": {"name": self.function, "arguments": ""},
                    }
                )
            self._text.append(content)
            if content:
                entries.append({"index": 0, "function": {"arguments": content}})
            return "", entries
        if self.mode == "required":
            self._text.append(content)
            return "", []
        return content, []

    def finish(self, finish_reason: str) -> tuple[str, list[dict[str, Any]], str]:
        content, entries = "", []
        if self._parser is not None:  # auto
            content = self._parser.flush()
        elif self.mode == "function":
            if not self._text:  # nothing generated: the header entry was never sent
                _, entries = self.feed("")
            assert self.function is not None
            self.calls = [ToolCall(self.function, "".join(self._text).strip(), self._call_id)]
        elif self.mode == "required":
            text = "".join(self._text)
            calls = calls_from_required(text, self._make_id)
            if calls is None:
                content = text
            else:
                self.calls = calls
                entries = tool_call_deltas(calls, 0)
        if self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, entries, finish_reason
