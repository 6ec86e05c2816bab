"""response_format: constrained decoding end to end (xgrammar masks in the sampler, the real engine).

Two vocabularies: the built-in model's character-level one (raw tokens) and the byte-level test
tokenizer on a random checkpoint (byte-level BPE), so the token tables xgrammar builds are exercised
in both encodings. A random model is the hard case: left alone it writes noise, so any valid JSON it
ends on is the grammar's doing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from server_support import LiveServer, byte_tokenizer_checkpoint, serving_checkpoint
from sovereign_runtime.builtin import resolve_builtin
from sovereign_runtime.engine import InvalidRequest, SamplingParams
from sovereign_runtime.engine.engine import EngineConfig, LLMEngine
from sovereign_runtime.engine.grammar import JSON_OBJECT_SCHEMA, MAX_SCHEMA_BYTES, Grammars
from sovereign_runtime.tokenizer import Tokenizer

MODEL = "tiny-json"
YES_NO = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "count"],
    "additionalProperties": False,
}


# ---- the parameters -------------------------------------------------------------------------------


def test_a_schema_is_checked_at_the_edge() -> None:
    assert SamplingParams(json_schema=JSON_OBJECT_SCHEMA).json_schema == JSON_OBJECT_SCHEMA
    for bad, fragment in (
        ("not json", "valid JSON"),
        ("[1, 2]", "a JSON object"),
        (json.dumps({"enum": ["x" * MAX_SCHEMA_BYTES]}), "at most"),
        (42, "JSON text"),
    ):
        with pytest.raises(InvalidRequest, match=fragment) as err:
            SamplingParams(json_schema=bad)  # type: ignore[arg-type]
        assert err.value.param == "json_schema"
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingParams(json_schema=JSON_OBJECT_SCHEMA, ignore_eos=True)


def test_the_schema_travels_to_a_remote_prefill() -> None:
    # The prefill samples the first token: it must constrain it with the same schema.
    params = SamplingParams(json_schema=json.dumps(YES_NO), max_tokens=50)
    assert params.for_first_token().json_schema == params.json_schema


# ---- the engine, built-in model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin_engine() -> LLMEngine:
    path = resolve_builtin("sovereign-tiny")
    engine = LLMEngine.from_pretrained(path, EngineConfig(max_num_seqs=8, num_kv_blocks=128))
    tokenizer = Tokenizer.from_dir(path)
    engine.runner.grammars = Grammars(tokenizer, engine.vocab_size, sorted(engine.scheduler.eos_token_ids))
    engine.tokenizer = tokenizer  # type: ignore[attr-defined]
    return engine


def _run(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> list[tuple[str, str | None]]:
    tokenizer: Tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    ids = [engine.add_request(tokenizer.encode(p), sp) for p, sp in zip(prompts, params, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    eos = engine.scheduler.eos_token_ids
    return [(tokenizer.decode([t for t in tokens[i] if t not in eos]), reasons[i]) for i in ids]


def test_sampled_output_matches_the_schema(builtin_engine: LLMEngine) -> None:
    schema = json.dumps(YES_NO)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, json_schema=schema) for s in range(6)]
    for text, reason in _run(builtin_engine, ["What is 2 + 3?"] * 6, params):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), YES_NO)


def test_json_object_gives_an_object_or_a_cut_prefix(builtin_engine: LLMEngine) -> None:
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=40, json_schema=JSON_OBJECT_SCHEMA)
        for s in range(4)
    ]
    for text, reason in _run(builtin_engine, ["Hello"] * 4, params):
        assert text.lstrip().startswith("{"), text
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert reason == "length"


def test_constrained_rows_leave_their_batch_neighbours_alone(builtin_engine: LLMEngine) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    ((alone, _),) = _run(builtin_engine, ["What is 4 + 4?"], [plain])
    mixed = _run(
        builtin_engine,
        ["What is 4 + 4?", "What is 1 + 2?", "What is 4 + 4?"],
        [plain, SamplingParams(temperature=0.0, max_tokens=200, json_schema=json.dumps(YES_NO)), plain],
    )
    assert mixed[0][0] == alone and mixed[2][0] == alone
    jsonschema.validate(json.loads(mixed[1][0]), YES_NO)


def test_a_schema_xgrammar_cannot_compile_is_refused(builtin_engine: LLMEngine) -> None:
    tokenizer: Tokenizer = builtin_engine.tokenizer  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequest, match="JSON Schema") as err:
        builtin_engine.make_sequence(
            tokenizer.encode("hi"), SamplingParams(json_schema=json.dumps({"type": "no-such-type"}))
        )
    assert err.value.param == "json_schema"


def test_an_engine_without_grammars_refuses_a_schema() -> None:
    engine = LLMEngine.from_pretrained(resolve_builtin("sovereign-tiny"), EngineConfig(num_kv_blocks=16))
    with pytest.raises(InvalidRequest, match="grammars"):
        engine.make_sequence([5, 6], SamplingParams(json_schema=JSON_OBJECT_SCHEMA))


# ---- the server, byte-level tokenizer on a random checkpoint ---------------------------------------


@pytest.fixture(scope="module")
def server(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    checkpoint = byte_tokenizer_checkpoint(tiny_checkpoint_factory, tmp_path_factory.mktemp("json") / "ckpt")
    with serving_checkpoint(checkpoint, MODEL, max_model_len=256, max_num_seqs=4, num_kv_blocks=64) as srv:
        yield srv


def _chat(server: LiveServer, response_format: Any, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Reply in JSON."}],
        "max_tokens": 120,
        "response_format": response_format,
        **extra,
    }
    return server.request("POST", "/v1/chat/completions", body)


def test_json_schema_through_the_api(server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": YES_NO, "strict": True}}
    for seed in range(3):
        status, answer = _chat(server, fmt, temperature=1.0, seed=seed)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), YES_NO)


def test_json_object_streams_through_the_api(server: LiveServer) -> None:
    status, answer = _chat(server, {"type": "json_object"}, temperature=0, max_tokens=40)
    assert status == 200, answer
    content = answer["choices"][0]["message"]["content"]
    assert content.lstrip().startswith("{")
    if answer["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize(
    ("fmt", "fragment"),
    [
        ("json", "must be an object"),
        ({"type": "xml"}, "'text', 'json_object' or 'json_schema'"),
        ({"type": "json_schema"}, "needs 'json_schema'"),
        ({"type": "json_schema", "json_schema": {"schema": YES_NO}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "JSON Schema"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(server: LiveServer, fmt: Any, fragment: str) -> None:
    status, answer = _chat(server, fmt)
    assert status == 400, answer
    assert answer["error"]["param"] == "response_format" and fragment in answer["error"]["message"]


def test_ignore_eos_with_a_schema_is_a_400(server: LiveServer) -> None:
    status, answer = _chat(server, {"type": "json_object"}, ignore_eos=True)
    assert status == 400 and answer["error"]["param"] == "response_format", answer
