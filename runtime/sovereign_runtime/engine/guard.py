"""The engine step's output guard: one request's failure ends that request, never the batch.

``StepGuard.execute`` runs a scheduled batch and returns one token per sampled row plus the sequences that
must end with an error instead:

- an exception while running the batch is isolated by bisection: each half runs again on its own, down to
  the single sequences whose inputs raise; everything else keeps its token from the same step (re-running a
  step rewrites the same KV slots, so the retry is idempotent);
- a sampled row whose logits are not finite (the sampler reports it as ``NONFINITE`` on its existing sync)
  is, when the model has FP8 linears and 16-bit activations, recomputed once without the rest of the batch
  with those linears dequantised to and computed in float32; a row still not finite after that, or on a
  model without a reduced-precision path, fails.

Failed sequences never get a token: the caller ends them with ``finish_reason="error"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..model.fp8 import fp8_linears, reference_precision
from .sampler import NONFINITE, SamplerOutput
from .scheduler import ScheduledBatch
from .sequence import Sequence

log = logging.getLogger("sovereign_runtime.engine")

NONFINITE_LOGITS = "nonfinite_logits"
STEP_EXCEPTION = "step_exception"


@dataclass(frozen=True)
class SequenceFailure:
    kind: str  # NONFINITE_LOGITS or STEP_EXCEPTION
    message: str


@dataclass
class GuardStats:
    nonfinite_logits_total: int = 0  # sequences that ended because their logits were not finite
    precision_fallbacks_total: int = 0  # float32 recomputes of a non-finite sequence (FP8 models)
    precision_fallbacks_recovered_total: int = 0  # of those, the ones whose recompute was finite
    isolated_exceptions_total: int = 0  # sequences failed alone by a step exception their inputs caused


@dataclass
class GuardedStep:
    """One sampled token per ``batch.sample`` row (``NONFINITE`` for failed rows), logprobs alike."""

    out: SamplerOutput
    failures: dict[Sequence, SequenceFailure] = field(default_factory=dict)


Run = Callable[[ScheduledBatch], SamplerOutput]


def _fatal(exc: Exception) -> bool:
    """An exception no request caused (``fatal = True``: the replica's process group broke): re-running
    parts of the batch cannot isolate it, so it fails every request."""
    return bool(getattr(exc, "fatal", False))


def sub_batch(batch: ScheduledBatch, keep: list[int]) -> ScheduledBatch:
    return ScheduledBatch(
        [batch.seqs[i] for i in keep],
        [batch.num_new_tokens[i] for i in keep],
        [batch.sample[i] for i in keep],
        None if batch.drafts is None else [batch.drafts[i] for i in keep],
    )


# A sequence's logit rows of one step: tokens, logprobs, top logprobs (several when it verified a draft).
Rows = tuple[list[int], list[float | None], list[list[tuple[int, float]] | None]]


def rows_by_sequence(part: ScheduledBatch, out: SamplerOutput) -> dict[Sequence, Rows]:
    """Split a step's sampled rows by sequence (a sequence verifying a draft owns one row per position)."""
    rows: dict[Sequence, Rows] = {}
    r = 0
    for i, seq in enumerate(part.seqs):
        n = part.logit_rows(i)
        if n:
            rows[seq] = (out.token_ids[r : r + n], out.logprobs[r : r + n], out.top_logprobs[r : r + n])
            r += n
    assert r == len(out.token_ids), "one sampled row per logit row"
    return rows


def step_shape(batch: ScheduledBatch) -> str:
    kind = (
        "decode"
        if batch.max_query_len == 1
        else "prefill"
        if not any(n == 1 for n in batch.num_new_tokens)
        else "mixed"
    )
    return (
        f"{kind} step: {len(batch)} sequences, {batch.num_tokens} tokens, longest chunk {batch.max_query_len}"
    )


class StepGuard:
    def __init__(self, model: nn.Module | object, dtype: torch.dtype = torch.float32) -> None:
        self.stats = GuardStats()
        # The reduced-precision path a non-finite row is recomputed without: FP8 weights dequantised to a
        # 16-bit activation dtype (with float32 activations they already are float32: nothing to fall back to).
        reduced = dtype in (torch.bfloat16, torch.float16)
        self._fp8 = fp8_linears(model) if reduced and isinstance(model, nn.Module) else []

    @property
    def has_precision_fallback(self) -> bool:
        return bool(self._fp8)

    def execute(self, batch: ScheduledBatch, run: Run) -> GuardedStep:
        try:
            out = run(batch)
        except Exception as exc:
            if _fatal(exc):
                raise
            parts, failures = self._isolated(batch, run)
        else:
            if NONFINITE not in out.token_ids:  # the common case: one scan of the sampled ids
                return GuardedStep(out)
            parts, failures = [(batch, out)], {}
        return self._resolve(batch, parts, failures, run)

    def _resolve(
        self,
        batch: ScheduledBatch,
        parts: list[tuple[ScheduledBatch, SamplerOutput]],
        failures: dict[Sequence, SequenceFailure],
        run: Run,
    ) -> GuardedStep:
        """Merge the parts' rows back into batch order, recompute or fail the non-finite ones."""
        rows: dict[Sequence, Rows] = {}
        nonfinite: list[int] = []  # batch indices
        index = {seq: i for i, seq in enumerate(batch.seqs)}
        for part, out in parts:
            for seq, seq_rows in rows_by_sequence(part, out).items():
                rows[seq] = seq_rows
                if NONFINITE in seq_rows[0]:
                    nonfinite.append(index[seq])
        if nonfinite and self._fp8:
            nonfinite = self._recompute(batch, sorted(nonfinite), run, rows, failures)
        for i in nonfinite:
            seq = batch.seqs[i]
            self.stats.nonfinite_logits_total += 1
            log.error(
                "non-finite logits for request %s at position %d (%s); the request ends with an error",
                seq.request_id,
                seq.num_computed_tokens + batch.num_new_tokens[i] - 1,
                step_shape(batch),
            )
            failures[seq] = SequenceFailure(
                NONFINITE_LOGITS, "the model produced non-finite logits for this request"
            )
        token_ids: list[int] = []
        logprobs: list[float | None] = []
        tops: list[list[tuple[int, float]] | None] = []
        for i, seq in enumerate(batch.seqs):
            n = batch.logit_rows(i)
            if not n:
                continue
            if seq in failures or seq not in rows:
                token_ids += [NONFINITE] * n
                logprobs += [None] * n
                tops += [None] * n
            else:
                token_ids += rows[seq][0]
                logprobs += rows[seq][1]
                tops += rows[seq][2]
        return GuardedStep(SamplerOutput(token_ids, logprobs, tops), failures)

    def _recompute(
        self,
        batch: ScheduledBatch,
        nonfinite: list[int],
        run: Run,
        rows: dict[Sequence, Rows],
        failures: dict[Sequence, SequenceFailure],
    ) -> list[int]:
        """Run the non-finite sequences again with float32 weights; returns those still not finite."""
        retry = sub_batch(batch, nonfinite)
        self.stats.precision_fallbacks_total += len(retry)
        log.warning(
            "non-finite logits in %s: recomputing %d sequence(s) in float32", step_shape(batch), len(retry)
        )
        with reference_precision(self._fp8):
            parts, retry_failures = self._isolated(retry, run, known_failing=False)
        failures.update(retry_failures)
        still: list[int] = []
        index = {seq: i for i, seq in enumerate(batch.seqs)}
        for part, out in parts:
            for seq, seq_rows in rows_by_sequence(part, out).items():
                if NONFINITE in seq_rows[0]:
                    still.append(index[seq])
                else:
                    rows[seq] = seq_rows
                    self.stats.precision_fallbacks_recovered_total += 1
        return sorted(still)

    def _isolated(
        self, batch: ScheduledBatch, run: Run, known_failing: bool = True
    ) -> tuple[list[tuple[ScheduledBatch, SamplerOutput]], dict[Sequence, SequenceFailure]]:
        """Bisect a batch that raised until the sequences whose inputs raise are alone."""
        if len(batch) == 1 or not known_failing:
            try:
                return [(batch, run(batch))], {}
            except Exception as exc:
                if _fatal(exc):
                    raise
                if len(batch) == 1:
                    seq = batch.seqs[0]
                    self.stats.isolated_exceptions_total += 1
                    log.exception(
                        "request %s failed in the engine step (%s)", seq.request_id, step_shape(batch)
                    )
                    return [], {seq: SequenceFailure(STEP_EXCEPTION, f"{type(exc).__name__}: {exc}")}
        log.warning("engine step failed (%s): retrying its halves apart", step_shape(batch))
        half = len(batch) // 2
        parts, failures = [], {}
        for keep in (list(range(half)), list(range(half, len(batch)))):
            p, f = self._isolated(sub_batch(batch, keep), run, known_failing=False)
            parts += p
            failures.update(f)
        return parts, failures
