"""OpenAI request validation and error shapes: pure functions from a JSON body to typed requests.

This module owns the OpenAI wire format (field names and JSON types, stop strings, what is unsupported);
the bounds of every sampling parameter belong to ``SamplingParams``, whose ``InvalidRequest`` names the
engine-side field, mapped here to the OpenAI parameter the client sent. Every user error becomes an
``APIError`` naming that parameter, so the HTTP layer only maps it to
``{"error": {"message", "type", "param", "code"}}`` with the right status.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.api import InvalidRequest
from ..engine.grammar import JSON_OBJECT_SCHEMA
from ..engine.sampling import SEED_LIMIT, SamplingDefaults, SamplingParams
from ..tokenizer import TEMPLATE_VARIABLES
from .tools import named_call_schema, required_calls_schema

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions call: each is a request the engine queues
MAX_CHOICES = 16  # 'n': choices per prompt, each a request of its own (prompts x n at most MAX_PROMPTS)
# Refused OpenAI fields: each answers a 400 that names the field and why it is refused.
UNSUPPORTED_FIELDS = {
    "functions": "the deprecated 'functions' API is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' is not supported; send 'tool_choice'",
}
MAX_TOOLS = 128  # OpenAI's limit on 'tools'
# OpenAI's rule for a function's name, plus dots (MCP servers' tool names use them; vLLM takes them).
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")
# vLLM's extra sampling fields this server does not implement, with the value that means "off":
# any other value is refused by name, never ignored (clients written for vLLM send them).
UNSUPPORTED_EXTRAS: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty only applies to beam search, which is not supported"),
    "prompt_logprobs": (None, "prompt logprobs are not supported"),
    "guided_json": (None, "use response_format with a json_schema"),
    "guided_regex": (None, "regex-guided decoding is not supported"),
    "guided_choice": (None, "choice-guided decoding is not supported"),
    "guided_grammar": (None, "grammar-guided decoding is not supported"),
    "structured_outputs": (None, "use response_format with a json_schema"),
    "bad_words": ([], "bad_words is not supported; logit_bias -100 bans a token"),
    "allowed_token_ids": (None, "allowed_token_ids is not supported"),
    "truncate_prompt_tokens": (None, "prompt truncation is not supported"),
    "include_stop_str_in_output": (False, "the output is always cut before the stop string"),
    "skip_special_tokens": (True, "special tokens are always left out of the text"),
    "spaces_between_special_tokens": (True, "decoding always uses the tokenizer's own spacing"),
}
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class APIError(Exception):
    """A client-visible error with an HTTP status and an OpenAI-style body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class SamplingRequest:
    """Sampling fields shared by both endpoints, JSON types checked; ``SamplingParams`` checks bounds."""

    # None: left out, the server's SamplingDefaults apply (the model's generation_config.json).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field the client used, for error messages
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: Any = field(default_factory=list)  # SamplingParams checks the list
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: chosen token plus n alternatives
    n: int = 1  # choices per prompt
    min_tokens: int = 0
    repetition_window: int | None = None  # None: the server's --repetition-window
    logit_bias: dict[str, Any] = field(default_factory=dict)  # SamplingParams checks keys and values
    presence_penalty: float = 0.0  # SamplingParams checks the ranges
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_p: float | None = None
    json_schema: str | None = None  # from response_format; SamplingParams checks it, the engine compiles it
    # Seconds the request may take from arrival to its last token (a Sovereign extension; the
    # server's --request-timeout caps it); None: the server's limit, if any.
    request_timeout: float | None = None
    # Engine field -> the OpenAI parameter the client sent for it, where the names differ.
    param_names: dict[str, str] = field(default_factory=dict)


@dataclass
class ToolRequest:
    """The request's ``tools`` and ``tool_choice``, checked and in OpenAI's shape for the chat template."""

    tools: list[dict[str, Any]]
    choice: str  # "none" | "auto" | "required" | "function" (one named function, ``function``)
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls

    def tool(self, name: str) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    sampling: SamplingRequest
    stream: bool = False
    include_usage: bool = False
    add_generation_prompt: bool = True
    tools: ToolRequest | None = None
    # Extra variables for the chat template (vLLM's and SGLang's field), e.g. DeepSeek-V3.1's `thinking`.
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    sampling: SamplingRequest
    stream: bool = False
    include_usage: bool = False
    # vLLM's extension: each choice also carries its prompt's and its output's token ids.
    return_token_ids: bool = False


def _bad(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(message, param=param, code=code)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


MAX_REQUEST_TIMEOUT_S = 86_400


def _get_number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"'{name}' must be a number, got {_type_name(value)}", "invalid_type")
    return float(value)


def _get_optional_number(body: dict[str, Any], name: str) -> float | None:
    return None if body.get(name) is None else _get_number(body, name, 0.0)


def _get_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _bad(name, f"'{name}' must be an integer, got {_type_name(value)}", "invalid_type")
    return value


def _get_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {_type_name(value)}", "invalid_type")
    return value


def _parse_sampling(body: dict[str, Any], chat: bool) -> SamplingRequest:
    s = SamplingRequest()
    s.temperature = _get_optional_number(body, "temperature")
    s.top_p = _get_optional_number(body, "top_p")
    s.top_k = _get_int(body, "top_k")
    for name in ("max_completion_tokens", "max_tokens"):
        value = _get_int(body, name)
        if value is not None and s.max_tokens is None:
            s.max_tokens, s.max_tokens_param = value, name
    s.param_names["max_tokens"] = s.max_tokens_param
    s.param_names["prompt"] = "messages" if chat else "prompt"
    s.seed = _get_int(body, "seed")
    s.min_tokens = _get_int(body, "min_tokens") or 0
    s.repetition_window = _get_int(body, "repetition_window")
    stop = body.get("stop")
    if stop is None:
        s.stop = []
    elif isinstance(stop, str):
        s.stop = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        s.stop = [x for x in stop if x]
    else:
        raise _bad("stop", "'stop' must be a string or a list of strings", "invalid_type")
    ids = body.get("stop_token_ids")
    if ids is not None:
        s.stop_token_ids = ids
    s.ignore_eos = _get_bool(body, "ignore_eos")
    if chat:
        if _get_bool(body, "logprobs"):
            s.logprobs = _get_int(body, "top_logprobs") or 0
            s.param_names["logprobs"] = "top_logprobs"
        elif body.get("top_logprobs") not in (None, 0):
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    else:
        s.logprobs = _get_int(body, "logprobs")
    n = _get_int(body, "n")
    if n is not None:
        if not 1 <= n <= MAX_CHOICES:
            raise _bad("n", f"'n' must be an integer in [1, {MAX_CHOICES}], got {n}")
        s.n = n
    best_of = _get_int(body, "best_of")
    if best_of is not None and best_of != 1:
        raise _bad("best_of", "only 'best_of': 1 is supported", "unsupported_value")
    for name, why in UNSUPPORTED_FIELDS.items():
        if body.get(name) not in (None, [], {}):
            raise _bad(name, f"'{name}': {why}; leave it out", "unsupported_value")
    if body.get("request_timeout") is not None:
        limit = _get_number(body, "request_timeout", 0.0)
        if not 0 < limit <= MAX_REQUEST_TIMEOUT_S:
            raise _bad(
                "request_timeout",
                f"'request_timeout' must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT_S}], got {limit:g}",
            )
        s.request_timeout = limit
    response_format = body.get("response_format")
    if response_format is not None:
        s.json_schema = _response_format_schema(response_format)
        s.param_names["json_schema"] = "response_format"
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            raise _bad(
                "logit_bias",
                f"'logit_bias' must be an object mapping token ids to biases, got {_type_name(logit_bias)}",
                "invalid_type",
            )
        s.logit_bias = logit_bias
    s.presence_penalty = _get_number(body, "presence_penalty", 0.0)
    s.frequency_penalty = _get_number(body, "frequency_penalty", 0.0)
    s.repetition_penalty = _get_optional_number(body, "repetition_penalty")
    s.min_p = _get_optional_number(body, "min_p")
    for name, (default, why) in UNSUPPORTED_EXTRAS.items():
        if name in body and body[name] is not None and body[name] != default:
            raise _bad(
                name, f"'{name}': {why}; leave it out or send {json.dumps(default)}", "unsupported_value"
            )
    return s


def _response_format_schema(response_format: Any) -> str | None:
    """The JSON Schema (JSON text) ``response_format`` asks the output to match; None for text."""
    if not isinstance(response_format, dict):
        raise _bad(
            "response_format",
            f"'response_format' must be an object, got {_type_name(response_format)}",
            "invalid_type",
        )
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(
                "response_format",
                "'response_format' of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}",
            )
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("response_format", "'response_format.json_schema.name' must be a non-empty string")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _bad(
                "response_format",
                f"'response_format.json_schema.schema' must be an object, got {_type_name(schema)}",
                "invalid_type",
            )
        # strict or not, the schema is enforced: constrained decoding never emits what it forbids.
        return json.dumps(schema)
    raise _bad(
        "response_format",
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "unsupported_value",
    )


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", "'stream_options' must be an object", "invalid_type")
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed with 'stream': true")
        include_usage = _get_bool(options, "include_usage")
    return stream, include_usage


def _parse_model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"'model' must be a string, got {_type_name(model)}", "invalid_type")
    return model


def _message_text(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad(
                    f"messages[{index}].content", "only text content parts are supported", "invalid_type"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(
        f"messages[{index}].content", "'content' must be a string or a list of text parts", "invalid_type"
    )


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of messages", "invalid_type")
    clean: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(
                f"messages[{i}]", "each message must be an object with 'role' and 'content'", "invalid_type"
            )
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"'role' must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        out = dict(msg)
        out["content"] = _message_text(msg.get("content"), i)
        if out["content"] is None and role != "assistant":
            raise _bad(f"messages[{i}].content", "'content' is required", "missing_required_parameter")
        calls = msg.get("tool_calls")
        if calls not in (None, []):
            if role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", "only assistant messages carry 'tool_calls'")
            out["tool_calls"] = _history_tool_calls(calls, i)
        else:
            out.pop("tool_calls", None)
            if out["content"] is None:
                out["content"] = ""  # an assistant turn with no text (OpenAI sends null)
        if role == "tool" and not isinstance(msg.get("tool_call_id", ""), str):
            raise _bad(f"messages[{i}].tool_call_id", "'tool_call_id' must be a string", "invalid_type")
        clean.append(out)
    stream, include_usage = _parse_stream(body)
    sampling = _parse_sampling(body, chat=True)
    tools = _parse_tools(body)
    if tools is not None and tools.choice != "none" and sampling.json_schema is not None:
        raise _bad(
            "response_format",
            "'response_format' constrains the output, so the model could not write a tool call: send"
            " 'response_format' or 'tools' with a 'tool_choice' other than 'none', not both",
        )
    # A forced call is decoded under its schema, as response_format is.
    if tools is not None and tools.choice == "required":
        sampling.json_schema = required_calls_schema(tools.tools, tools.parallel)
        sampling.param_names["json_schema"] = "tools"
    elif tools is not None and tools.function is not None:
        sampling.json_schema = named_call_schema(tools.tool(tools.function))
        sampling.param_names["json_schema"] = "tools"
    return ChatRequest(
        model=_parse_model(body),
        messages=clean,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        add_generation_prompt=_get_bool(body, "add_generation_prompt", True),
        tools=tools,
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
    )


def _template_kwargs(value: Any) -> dict[str, Any]:
    """``chat_template_kwargs``: more variables for the template; the ones the server sets are refused
    rather than silently overridden (or silently overriding)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(
            "chat_template_kwargs",
            f"'chat_template_kwargs' must be an object of template variables, got {_type_name(value)}",
            "invalid_type",
        )
    taken = sorted(set(value) & TEMPLATE_VARIABLES)
    if taken:
        raise _bad(
            "chat_template_kwargs",
            f"'chat_template_kwargs' may not set {taken}: the server sets them (send 'messages', 'tools'"
            " or 'add_generation_prompt' as request fields)",
        )
    return dict(value)


def _history_tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls`` for the template: ``arguments`` as JSON text (OpenAI's wire form;
    DeepSeek's templates concatenate it), an object argument written out as JSON."""
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(param, "'tool_calls' must be a list of tool calls", "invalid_type")
    clean = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise _bad(
                where, "each tool call must be {'type': 'function', 'function': {'name', 'arguments'}}"
            )
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{where}.function", "'function' must be an object with a non-empty 'name'")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise _bad(
                f"{where}.function.arguments",
                "'arguments' must be a JSON string or an object",
                "invalid_type",
            )
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise _bad(f"{where}.id", "'id' must be a string", "invalid_type")
        clean.append(
            {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        )
    return clean


def _parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when no tools were sent."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = _get_bool(body, "parallel_tool_calls", True)
    if tools in (None, []):
        if choice not in (None, "none"):
            raise _bad("tool_choice", "'tool_choice' is only allowed when 'tools' are sent")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"'tools' must be a list of tools, got {_type_name(tools)}", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"'tools' takes at most {MAX_TOOLS} tools, got {len(tools)}")
    clean: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(where, "each tool must be {'type': 'function', 'function': {'name': ..., ...}}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "'function' must be an object", "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise _bad(
                f"{where}.function.name",
                f"a function's 'name' must be 1 to 64 letters, digits, '_', '-' or '.', got {name!r}",
            )
        if any(t["function"]["name"] == name for t in clean):
            raise _bad(f"{where}.function.name", f"two tools are named {name!r}; names must be unique")
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"{where}.function.description", "'description' must be a string", "invalid_type")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(
                f"{where}.function.parameters", "'parameters' must be a JSON Schema object", "invalid_type"
            )
        clean.append({"type": "function", "function": dict(fn)})
    if choice is None:
        return ToolRequest(clean, "auto", parallel=parallel)
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise _bad(
                "tool_choice",
                f"'tool_choice' must be one of {list(TOOL_CHOICES)} or"
                f" {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
            )
        return ToolRequest(clean, choice, parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad(
            "tool_choice",
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "invalid_type",
        )
    if not any(t["function"]["name"] == name for t in clean):
        known = [t["function"]["name"] for t in clean]
        raise _bad(
            "tool_choice", f"'tool_choice' names the function {name!r}, which is not in 'tools' {known}"
        )
    return ToolRequest(clean, "function", function=name, parallel=parallel)


@dataclass
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's): a completion ``prompt`` or a chat's ``messages`` rendered by the
    template (with ``tools``, ``add_generation_prompt`` and ``chat_template_kwargs`` as a chat takes them)."""

    model: str | None
    prompt: str | None = None
    chat: ChatRequest | None = None
    add_special_tokens: bool = True


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    if ("prompt" in body) == ("messages" in body):
        raise _bad(
            "prompt",
            "send exactly one of 'prompt' (text) and 'messages' (a chat)",
            "missing_required_parameter",
        )
    model = _parse_model(body)
    if "messages" in body:
        return TokenizeRequest(model, chat=parse_chat_request(body))
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise _bad("prompt", f"'prompt' must be a string, got {_type_name(prompt)}", "invalid_type")
    return TokenizeRequest(
        model, prompt=prompt, add_special_tokens=_get_bool(body, "add_special_tokens", True)
    )


def parse_detokenize_request(body: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """``POST /detokenize``: the model and the token ids to turn back into text."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise _bad("tokens", "'tokens' must be a list of token ids", "invalid_type")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise _bad("tokens", f"token ids in 'tokens' must be in [0, {vocab_size})")
    return _parse_model(body), tokens


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def parse_completion_request(body: Any, vocab_size: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt", "'prompt' is required", "missing_required_parameter")
    prompt = body["prompt"]
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_token_list(prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_list(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise _bad(
            "prompt",
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "invalid_type",
        )
    if len(prompts) > MAX_PROMPTS:
        raise _bad("prompt", f"'prompt' takes at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    for p in prompts:
        if isinstance(p, list) and any(not 0 <= t < vocab_size for t in p):
            raise _bad("prompt", f"token ids in 'prompt' must be in [0, {vocab_size})")
    if _get_bool(body, "echo"):
        raise _bad("echo", "'echo' is not supported", "unsupported_value")
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], "none"):
            raise _bad(
                name, f"'{name}' belongs to /v1/chat/completions; leave it out here", "unsupported_value"
            )
    if body.get("suffix"):
        raise _bad("suffix", "'suffix' is not supported", "unsupported_value")
    stream, include_usage = _parse_stream(body)
    sampling = _parse_sampling(body, chat=False)
    if len(prompts) * sampling.n > MAX_PROMPTS:
        raise _bad(
            "n",
            f"{len(prompts)} prompts x 'n' {sampling.n} = {len(prompts) * sampling.n} choices; one request"
            f" takes at most {MAX_PROMPTS}",
        )
    return CompletionRequest(
        model=_parse_model(body),
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_get_bool(body, "return_token_ids"),
    )


def resolve_max_tokens(
    sampling: SamplingRequest, prompt_len: int, max_model_len: int, default: int | None
) -> int:
    """The request's token budget; 400 naming the parameter when prompt plus output exceed the context."""
    if prompt_len >= max_model_len:
        raise APIError(
            f"the prompt is {prompt_len} tokens, but this model's context length is {max_model_len} tokens",
            param=sampling.param_names["prompt"],
            code="context_length_exceeded",
        )
    if sampling.max_tokens is None:
        return max_model_len - prompt_len if default is None else min(default, max_model_len - prompt_len)
    if prompt_len + sampling.max_tokens > max_model_len:
        raise APIError(
            f"this model's context length is {max_model_len} tokens; the prompt has {prompt_len} and "
            f"{sampling.max_tokens_param} asks for {sampling.max_tokens} more ({prompt_len + sampling.max_tokens}); "
            f"shorten the prompt or lower {sampling.max_tokens_param}",
            param=sampling.max_tokens_param,
            code="context_length_exceeded",
        )
    return sampling.max_tokens


def sampling_params(
    sampling: SamplingRequest,
    max_tokens: int,
    vocab_size: int,
    repetition_window: int = 0,
    defaults: SamplingDefaults | None = None,
) -> SamplingParams:
    """The engine's parameters for one prompt; a bound ``SamplingParams`` refuses becomes a 400 naming the
    parameter the client sent. ``vocab_size`` bounds the token ids in ``logit_bias``; ``defaults`` fill
    the sampling fields the request left out."""
    d = defaults or SamplingDefaults()

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        params = SamplingParams(
            temperature=given(sampling.temperature, d.temperature),
            top_p=given(sampling.top_p, d.top_p),
            top_k=given(sampling.top_k, d.top_k),
            min_p=given(sampling.min_p, d.min_p),
            repetition_penalty=given(sampling.repetition_penalty, d.repetition_penalty),
            max_tokens=max_tokens,
            seed=sampling.seed,
            stop_token_ids=sampling.stop_token_ids,
            ignore_eos=sampling.ignore_eos,
            logprobs=sampling.logprobs,
            # A floor above the budget asks for the whole budget.
            min_tokens=min(sampling.min_tokens, max_tokens),
            repetition_window=(
                repetition_window if sampling.repetition_window is None else sampling.repetition_window
            ),
            logit_bias=sampling.logit_bias,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            json_schema=sampling.json_schema,
        )
        params.check_vocab(vocab_size)
        return params
    except InvalidRequest as exc:
        raise request_error(exc, sampling.param_names) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One prompt's ``n`` choices: the same parameters, a seeded request's seed counting up from its own
    so the choices differ and each is reproducible."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + j) % SEED_LIMIT) for j in range(n)]


def request_error(exc: InvalidRequest, param_names: Mapping[str, str]) -> APIError:
    """The OpenAI error for a request the engine refused: its field renamed to the client's parameter."""
    if exc.param is None:
        return APIError(exc.rule, code="invalid_value")
    param = param_names.get(exc.param, exc.param)
    return APIError(f"'{param}' {exc.rule}", param=param, code="invalid_value")
