"""The synthetic task `builtin:sovereign-tiny` is trained on: addition of two numbers below 1000.

The assistant answers with a short column-by-column reasoning trace, then the sum::

    user:      What is 347 + 589?
    assistant: <think>7+9=16 4+8+1=13 3+5+1=9</think>936

Each trace column is ``x+y[+1]=s`` from the least significant digit; ``+1`` appears when the previous
column carried. The answer is exact, so anyone (tests, the server's end-to-end checks, the demo) can score a
completion with :func:`check_answer`.

Held-out split: every pair ``(a, b)`` belongs to exactly one partition, decided by a fixed hash
(:func:`is_heldout`, about 1 in 16 pairs). Training only ever samples the training partition;
:func:`make_questions` draws evaluation questions from the held-out partition, reproducibly per seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MAX_OPERAND = 999
_HELDOUT_MODULUS = 16
_QUESTION_RE = re.compile(r"What is (\d+) \+ (\d+)\?")


@dataclass(frozen=True)
class Question:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        """The user message content."""
        return f"What is {self.a} + {self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def messages(self) -> list[dict[str, str]]:
        """OpenAI / HF chat messages for this question (single user turn, no system prompt)."""
        return [{"role": "user", "content": self.prompt}]


def is_heldout(a: int, b: int) -> bool:
    """Fixed partition of all pairs; a multiplicative hash so neighbouring pairs land in both halves."""
    key = a * (MAX_OPERAND + 1) + b
    return ((key * 2654435761) >> 7) % _HELDOUT_MODULUS == 0


def _sample_operand(rng: random.Random) -> int:
    # Pick the digit count first so 1- and 2-digit operands are not drowned out by 3-digit ones.
    digits = rng.choice((1, 2, 3, 3))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _sample(rng: random.Random, heldout: bool) -> Question:
    while True:
        a, b = _sample_operand(rng), _sample_operand(rng)
        if is_heldout(a, b) == heldout:
            return Question(a, b)


def sample_training_question(rng: random.Random) -> Question:
    """One question from the training partition."""
    return _sample(rng, heldout=False)


def make_questions(n: int, seed: int = 0) -> list[Question]:
    """``n`` held-out questions, the same list for the same seed (never seen in training)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [_sample(rng, heldout=True) for _ in range(n)]


def reasoning_trace(a: int, b: int) -> str:
    """The column additions, least significant digit first, e.g. ``7+9=16 4+8+1=13 3+5+1=9``."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    carry = 0
    steps: list[str] = []
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+1={s}" if carry else f"{x}+{y}={s}")
        carry = s // 10
    return " ".join(steps)


def completion_text(question: Question) -> str:
    """The exact assistant turn the model is trained to produce (before the end-of-sentence token)."""
    return f"<think>{reasoning_trace(question.a, question.b)}</think>{question.answer}"


def parse_question(text: str) -> Question:
    """Recover the question from its user prompt (so callers may pass the prompt string around)."""
    m = _QUESTION_RE.search(text)
    if m is None:
        raise ValueError(f"not a sovereign-tiny question: {text!r}")
    return Question(int(m.group(1)), int(m.group(2)))


def extract_answer(completion: str) -> str:
    """The final answer of a completion: text after the last ``</think>`` (or all of it), stripped.

    Works on the raw completion and on the ``content`` the server returns after its reasoning parser moved
    the ``<think>`` block into ``reasoning_content``.
    """
    return completion.rsplit("</think>", 1)[-1].strip()


def check_answer(question: Question | str, completion: str) -> bool:
    """True when the completion's final answer is exactly the sum."""
    q = parse_question(question) if isinstance(question, str) else question
    return extract_answer(completion) == q.answer
