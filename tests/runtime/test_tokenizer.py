"""Tokenizer files, chat templates, streaming detokenization, stop strings and the reasoning parser."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from server_support import ASSISTANT, BOS, USER, write_byte_tokenizer
from sovereign_runtime.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    ReasoningParser,
    StopStringMatcher,
    Tokenizer,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_byte_tokenizer(tmp_path_factory.mktemp("tok")))


def test_loads_special_tokens_from_config(tok: Tokenizer) -> None:
    assert tok.bos_token == BOS  # written as an AddedToken dict
    assert tok.eos_token == "</s>"
    assert tok.eos_token_id == tok.hf.token_to_id("</s>")
    assert tok.vocab_size == 256 + 6


def test_chat_template_renders_like_hf(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == f"{BOS}Be brief.\n{USER}hi\n{ASSISTANT}"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == f"{BOS}Be brief.\n{USER}hi\n"
    _text, ids = tok.encode_chat(messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template wrote BOS once
    assert tok.decode(ids) == "Be brief.\nhi\n"  # special tokens are not shown


def test_chat_template_raise_exception_and_sandbox(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "a"))
    with pytest.raises(ChatTemplateError, match="unsupported role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    sandboxed = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "b", chat_template=evil))
    with pytest.raises(ChatTemplateError):
        sandboxed.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path))
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_incremental_detokenizer_never_splits_characters(tok: Tokenizer) -> None:
    text = "héllo wörld → 数学 🙂 <think>ok</think> done"
    ids = tok.encode(text, add_special_tokens=False)
    # Multi-byte characters span several tokens: one token alone decodes to a replacement character.
    assert any("\ufffd" in tok.hf.decode([i]) for i in ids)
    rng = random.Random(0)
    for _ in range(20):
        detok = IncrementalDetokenizer(tok, tok.encode("prompt ", add_special_tokens=False))
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            deltas.append(detok.add(ids[i : i + n]))
            i += n
        deltas.append(detok.flush())
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_hides_special_tokens_but_keeps_think(tok: Tokenizer) -> None:
    ids = [*tok.encode("<think>a</think>b", add_special_tokens=False), tok.eos_token_id]
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert out == "<think>a</think>b"


def test_stop_string_trims_and_holds_back_prefixes() -> None:
    m = StopStringMatcher(["STOP", "\n\n"])
    assert m.feed("hello ST") == "hello "  # "ST" could begin "STOP"
    assert m.feed("ART ") == "START "
    assert m.feed("and S") == "and "
    assert m.feed("TOP more") == ""
    assert m.stopped and m.matched == "STOP"
    assert m.feed("ignored") == ""


def test_stop_string_earliest_match_wins_and_flush() -> None:
    m = StopStringMatcher(["bc", "abcd"])
    assert m.feed("xabcd") == "x"  # "abcd" starts before "bc"
    assert m.matched == "abcd"
    m2 = StopStringMatcher(["zz"])
    assert m2.feed("abz") == "ab"
    assert m2.flush() == "z"  # the request ended: held-back text is real output
    assert StopStringMatcher([]).feed("anything") == "anything"


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_reasoning_parser_streaming_equals_whole(chunk: int) -> None:
    text = "<think>7+9=16 carry</think>\n936"
    parser = ReasoningParser()
    reasoning, content = "", ""
    for i in range(0, len(text), chunk):
        r, c = parser.feed(text[i : i + chunk])
        reasoning, content = reasoning + r, content + c
    r, c = parser.flush()
    assert (reasoning + r, content + c) == ("7+9=16 carry", "936")
    assert ReasoningParser.split(text) == ("7+9=16 carry", "936")


def test_reasoning_parser_without_think_and_open_prompt() -> None:
    assert ReasoningParser.split("plain answer") == (None, "plain answer")
    # The prompt opened the trace: everything up to </think> is reasoning.
    assert ReasoningParser.split("step</think>42", started_in_reasoning=True) == ("step", "42")
    # Truncated inside the trace: all of it is reasoning, no content.
    assert ReasoningParser.split("<think>still going") == ("still going", "")
    # A "<" that is not a tag is content.
    assert ReasoningParser.split("<b>bold") == (None, "<b>bold")
