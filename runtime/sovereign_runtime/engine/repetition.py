"""Degenerate-output detection: a request whose last ``window`` tokens repeat one short pattern.

A model that went wrong (a broken kernel, a bad FP8 upgrade) often emits one token, or a short cycle of
tokens, until ``max_tokens``. ``RepetitionDetector`` follows one sequence's output in O(``max_period``) per
token: for each period p it counts how many consecutive tokens equal the token p places earlier; when that
run covers the whole window the output is degenerate. Off unless a request (or the server flag) sets a
window; windows are long (default minimum 16) so that ordinary repetition such as a list is not cut short.
"""

from __future__ import annotations

from .api import InvalidRequest

MIN_WINDOW = 16
MAX_WINDOW = 4096
MAX_PERIOD = 8


def check_window(window: int) -> None:
    """Raise ``InvalidRequest`` naming the parameter unless ``window`` is 0 (off) or in range."""
    if isinstance(window, bool) or not isinstance(window, int):
        raise InvalidRequest("repetition_window", f"must be an integer, got {window!r}")
    if window != 0 and not MIN_WINDOW <= window <= MAX_WINDOW:
        raise InvalidRequest(
            "repetition_window", f"must be 0 (off) or in [{MIN_WINDOW}, {MAX_WINDOW}], got {window}"
        )


class RepetitionDetector:
    def __init__(self, window: int, max_period: int = MAX_PERIOD) -> None:
        check_window(window)
        self.window = window
        self.max_period = min(max_period, max(1, window // 2))
        self._recent: list[int] = []  # the last max_period tokens
        self._runs = [0] * (self.max_period + 1)  # index p: tokens equal to the one p places earlier
        self.period: int | None = None  # set once degenerate

    def feed(self, token: int) -> bool:
        """Add one output token; True once the last ``window`` tokens repeat a pattern of <= max_period."""
        if self.period is not None:
            return True
        recent = self._recent
        for p in range(1, self.max_period + 1):
            if len(recent) >= p and recent[-p] == token:
                self._runs[p] += 1
                # ``run`` tokens each equal their p-th predecessor, plus the p tokens of the first cycle.
                if self._runs[p] + p >= self.window:
                    self.period = p
            else:
                self._runs[p] = 0
        recent.append(token)
        if len(recent) > self.max_period:
            del recent[0]
        return self.period is not None
