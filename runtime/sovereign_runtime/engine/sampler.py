"""Batched token sampling: logit bias, penalties, greedy, temperature, min-p, top-k, top-p,
per-request seeds, logprobs.

A request's ``logit_bias`` is added to its row's logits first, then its repetition, presence and
frequency penalties are applied to the tokens it already holds, so every later step (greedy argmax,
temperature, filters, logprobs) sees that distribution, as OpenAI's API does. Rows without any of
them cost nothing; a batch with some costs a scatter or two into a copy of the logits.

One call handles a whole batch with tensor ops; the only per-row Python work is drawing the noise for
seeded requests from their own ``torch.Generator`` (that is what makes a seeded request reproducible
regardless of what it is batched with).

The output guard rides on the one synchronisation the sampler already pays: each row's logits are
summed on the device (one reduction), the sums are copied after the sampled ids (nothing left to wait
for by then) and a row whose sum is not finite comes back as token ``NONFINITE``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .sampling import SamplingParams

if TYPE_CHECKING:
    from .grammar import Grammars

# Token id reported for a row whose logits were not finite (never a real token: embedding lookups reject it).
NONFINITE = -1


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Log-probability of each chosen token under the model's untempered distribution after the request's
    # logit_bias (OpenAI computes logprobs after the bias too); None where the request did not ask.
    logprobs: list[float | None]
    # The ``params.logprobs`` most likely (token, logprob) pairs per row, or None.
    top_logprobs: list[list[tuple[int, float]] | None]

    def nonfinite_rows(self) -> list[int]:
        """Rows whose logits were not finite (their token is ``NONFINITE``, never a sampled one)."""
        return [i for i, t in enumerate(self.token_ids) if t == NONFINITE]


class Sampler:
    def __init__(self, check_finite: bool = True) -> None:
        # Off only to measure what the check costs (bench); serving always checks.
        self.check_finite = check_finite

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        grammars: tuple[Grammars, list[Any | None]] | None = None,
        history: list[tuple[list[int], int]] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` (float32 ``[rows, vocab]``). ``grammars``: the
        engine's compiled grammars and each row's matcher (None: unconstrained), for ``json_schema``.
        ``history``: each row's tokens so far and how many of them are the prompt, which its
        penalties count (read only for rows whose params are ``penalized``)."""
        rows = logits.shape[0]
        assert len(params) == rows == len(generators)
        # A row's sum is finite exactly when every logit is (NaN and +-inf propagate; finite logits of
        # any sane model are far from fp32 overflow): one reduction, no [rows, vocab] mask. Taken on
        # the model's own logits, before a grammar sets the forbidden ones to -inf. The sums are read
        # after the sampled ids (whose copy is the step's one sync) and checked in Python: torch's
        # isfinite is several kernels, which cost 3 % of a small model's decode step on CPU.
        sums = logits.sum(dim=-1) if self.check_finite else None
        if grammars is not None:
            grammars[0].apply_masks(logits, grammars[1])
        logits = apply_logit_bias(logits, params)
        if history is not None:
            logits = apply_penalties(logits, params, history)
        greedy = [p.temperature == 0.0 for p in params]
        chosen = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, params, generators, greedy)
        token_ids = chosen.tolist()
        if sums is not None:
            token_ids = [
                t if math.isfinite(x) else NONFINITE for t, x in zip(token_ids, sums.tolist(), strict=True)
            ]

        want = [p.logprobs for p in params]
        logprobs: list[float | None] = [None] * rows
        top: list[list[tuple[int, float]] | None] = [None] * rows
        if any(n is not None for n in want):
            logp = torch.log_softmax(logits.float(), dim=-1)
            chosen_lp = logp.gather(1, chosen.view(-1, 1)).view(-1).tolist()
            max_n = max(n for n in want if n is not None)
            if max_n > 0:
                top_vals, top_ids = logp.topk(max_n, dim=-1)
                top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
            for i, n in enumerate(want):
                if n is None:
                    continue
                logprobs[i] = chosen_lp[i]
                top[i] = list(zip(top_ids_l[i][:n], top_vals_l[i][:n], strict=True)) if n > 0 else []
        return SamplerOutput(token_ids, logprobs, top)

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        _rows, vocab = logits.shape
        device = logits.device
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        scaled = logits.float() / temps.view(-1, 1)
        min_ps = [p.min_p for p in params]
        if any(min_ps):
            # min-p: relative to each row's most likely token after temperature (vLLM's order).
            probs = torch.softmax(scaled, dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_ps, device=device).view(-1, 1)
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
        top_ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        top_ps = [p.top_p for p in params]
        filtered = any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps)
        if filtered:
            # Work in sorted order: top-k is a rank cut, top-p a cumulative-mass cut; both keep rank 0.
            scaled, order = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device).view(1, -1)
            drop = ranks >= torch.tensor(top_ks, device=device).view(-1, 1)
            probs = torch.softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before > torch.tensor(top_ps, device=device).view(-1, 1)
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        # Gumbel-style draw: argmax(p / E) with E ~ Exp(1) samples from p, and lets each row use its own
        # generator without a per-row multinomial call.
        noise = torch.empty_like(probs).exponential_()
        for i, g in enumerate(generators):
            if g is not None and not greedy[i]:
                _draw_noise(noise[i], g)
        picked = (probs / noise).argmax(dim=-1)
        if filtered:
            picked = order.gather(1, picked.view(-1, 1)).view(-1)
        if any(greedy):
            mask = torch.tensor(greedy, device=device)
            picked = torch.where(mask, logits.argmax(dim=-1), picked)
        return picked

    @staticmethod
    def skip_token(params: SamplingParams, generator: torch.Generator | None, vocab_size: int) -> None:
        """Consume from ``generator`` exactly what sampling one token for ``params`` consumes.

        A sequence whose first token was sampled elsewhere (a remote prefill, seeded alike) then draws its
        second token from where a unified run would, so a seeded request samples the same continuation.
        """
        if generator is not None and not params.greedy:
            _draw_noise(torch.empty(vocab_size, dtype=torch.float32, device=generator.device), generator)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], history: list[tuple[list[int], int]]
) -> torch.Tensor:
    """``logits`` with each penalized row's penalties applied, as vLLM orders them: a positive logit of
    any token of the prompt or the output divided by ``repetition_penalty`` (a negative one
    multiplied), then every output token lowered by ``presence_penalty`` once and
    ``frequency_penalty`` per occurrence. A new tensor; the same one when no row is penalized."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    seen_rows: list[int] = []
    seen_cols: list[int] = []
    factors: list[float] = []
    for i, p in enumerate(params):
        if not p.penalized:
            continue
        tokens, prompt_len = history[i]
        if p.repetition_penalty != 1.0 and tokens:
            seen = set(tokens)
            seen_rows.extend([i] * len(seen))
            seen_cols.extend(seen)
            factors.extend([p.repetition_penalty] * len(seen))
        if (p.presence_penalty or p.frequency_penalty) and len(tokens) > prompt_len:
            counts = Counter(tokens[prompt_len:])
            rows.extend([i] * len(counts))
            cols.extend(counts.keys())
            values.extend(-(p.presence_penalty + p.frequency_penalty * n) for n in counts.values())
    if not rows and not seen_rows:
        return logits
    penalized = logits.clone()
    if seen_rows:
        device = logits.device
        at = (torch.tensor(seen_rows, device=device), torch.tensor(seen_cols, device=device))
        picked = penalized[at]
        factor = torch.tensor(factors, dtype=logits.dtype, device=device)
        penalized[at] = torch.where(picked > 0, picked / factor, picked * factor)
    if rows:
        _add_at_(penalized, rows, cols, values)
    return penalized


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` with each row's ``logit_bias`` added (a new tensor; the same one when no row has one).

    Token ids were checked against the vocabulary when the request was admitted (``check_vocab``).
    """
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:  # list extends, not a Python loop per token: up to 300 per row, every step
            rows.extend([i] * len(p.logit_bias))
            cols.extend(p.logit_bias.keys())
            values.extend(p.logit_bias.values())
    if not rows:
        return logits
    biased = logits.float().clone()
    _add_at_(biased, rows, cols, values)
    return biased


def _add_at_(logits: torch.Tensor, rows: list[int], cols: list[int], values: list[float]) -> None:
    """Add ``values`` at (``rows``, ``cols``) of ``logits`` in place, repeated positions summed."""
    device = logits.device
    logits.index_put_(
        (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
        torch.tensor(values, device=device, dtype=logits.dtype),
        accumulate=True,
    )


def _draw_noise(row: torch.Tensor, generator: torch.Generator) -> None:
    """One token's noise for one seeded row (float32, vocabulary wide): the only draw a token takes."""
    row.exponential_(generator=generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
