"""The synthetic task behind builtin:sovereign-tiny: traces, answer checking, held-out split."""

from __future__ import annotations

import random

import pytest
from sovereign_runtime.builtin import tasks


def test_reasoning_trace_marks_carries_column_by_column() -> None:
    assert tasks.reasoning_trace(347, 589) == "7+9=16 4+8+1=13 3+5+1=9"
    assert tasks.reasoning_trace(5, 7) == "5+7=12"
    # The final carry has no column of its own: the answer carries it.
    assert tasks.reasoning_trace(999, 1) == "9+1=10 9+0+1=10 9+0+1=10"


def test_completion_text_ends_with_exact_sum() -> None:
    q = tasks.Question(999, 1)
    assert tasks.completion_text(q) == "<think>9+1=10 9+0+1=10 9+0+1=10</think>1000"
    assert q.prompt == "What is 999 + 1?"
    assert q.messages() == [{"role": "user", "content": "What is 999 + 1?"}]


@pytest.mark.parametrize(
    ("completion", "ok"),
    [
        ("<think>7+9=16 4+8+1=13 3+5+1=9</think>936", True),
        ("936", True),  # server content after its reasoning parser removed the <think> block
        ("\n\n936 ", True),
        ("<think>7+9=16</think>935", False),
        ("<think>wrong trace</think>9360", False),
        ("<think>7+9=16 4+8+1=13 3+5+1=9", False),  # reasoning never closed: no answer
        ("", False),
    ],
)
def test_check_answer(completion: str, ok: bool) -> None:
    q = tasks.Question(347, 589)
    assert tasks.check_answer(q, completion) is ok
    assert tasks.check_answer(q.prompt, completion) is ok  # the prompt text works as the question too


def test_parse_question_rejects_other_prompts() -> None:
    assert tasks.parse_question("What is 12 + 340?") == tasks.Question(12, 340)
    with pytest.raises(ValueError, match="not a sovereign-tiny question"):
        tasks.parse_question("hello")


def test_make_questions_is_reproducible_and_held_out() -> None:
    first = tasks.make_questions(200, seed=3)
    assert first == tasks.make_questions(200, seed=3)
    assert first != tasks.make_questions(200, seed=4)
    assert all(tasks.is_heldout(q.a, q.b) for q in first)
    assert all(0 <= q.a <= tasks.MAX_OPERAND and 0 <= q.b <= tasks.MAX_OPERAND for q in first)
    with pytest.raises(ValueError):
        tasks.make_questions(-1)


def test_training_sampler_never_yields_held_out_pairs() -> None:
    rng = random.Random(0)
    drawn = [tasks.sample_training_question(rng) for _ in range(3000)]
    assert not any(tasks.is_heldout(q.a, q.b) for q in drawn)
    # All operand sizes appear, so short questions are trained too.
    assert {len(str(q.a)) for q in drawn} == {1, 2, 3}


def test_heldout_partition_is_a_sixteenth() -> None:
    pairs = [(a, b) for a in range(0, 1000, 7) for b in range(1000)]
    fraction = sum(tasks.is_heldout(a, b) for a, b in pairs) / len(pairs)
    assert 0.05 < fraction < 0.075
