"""Speculative decoding with DeepSeek-V3's own multi-token-prediction (MTP) layer as the draft.

After each step the MTP layer drafts up to K tokens per decoding sequence; the next step's one forward
verifies them: the sequence's chunk is its last token followed by the draft, every position gets logits,
and the tokens the model itself picks at those positions are kept up to the first one that differs from
the draft (plus that one). So the output is the model's own, token for token:

- greedy: the argmax at each position; a draft token is kept exactly when it is that argmax;
- sampled: each position's token is drawn by the ordinary sampler with the request's own generator, and
  a draft token is kept while it equals the draw. This is rejection sampling against a draft that puts all
  its mass on one token (accept with probability p(draft), else draw from p without it), so each output
  token is distributed as without speculation; the request's generator is then rewound to where exactly
  the kept tokens' draws leave it, so a seeded request gives the same tokens with or without speculation.

The MTP layer (``model.layers.{N}`` in the checkpoint) has its own latent KV pages: the engine's cache
gets one more layer, in the same blocks as the main layers. MTP row ``p`` is computed from the main model's
final hidden state at ``p`` and the embedding of token ``p + 1`` and predicts token ``p + 2``
(docs/builtin-model.md, "MTP contract"). After every forward the MTP layer runs over the positions whose
main KV was kept (a prompt chunk, or the verified positions), which fills its cache and gives the first
draft token from the last row; further draft tokens chain the MTP layer on its own output. Drafted
positions' KV past what is accepted is garbage that later writes replace; blocks that held only such
positions go back to the pool at once (``Scheduler.update_tokens``).

Adaptive: above ``max_batch_size`` running sequences decode is compute-bound and drafting costs more than
it returns; the engine then decodes one token per step and skips the MTP layer, and drafts again once the
batch is back at or below the threshold. Requests with a ``json_schema`` are never drafted (their grammar
masks each position from the one before), nor are those with presence or frequency penalties (each
position's logits depend on the tokens before it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..model.context import AttentionMetadata, attention_context
from .model_runner import paged_metadata
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence

log = logging.getLogger("sovereign_runtime.engine")

ALGORITHMS = ("mtp",)
MAX_DRAFT_TOKENS = 4
# Above this many running sequences the CPU engine decodes without drafts (bench/speculative.py measures
# where drafting stops paying on the built-in model; docs/BENCHMARKS.md).
DEFAULT_MAX_BATCH_SIZE = 8


@dataclass
class SpeculativeConfig:
    algorithm: str = "mtp"
    num_draft_tokens: int = 1  # K: draft tokens per step
    # Draft only while at most this many sequences run (0: never adaptive, always draft).
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"speculative algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}"
            )
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"speculative num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}"
            )
        if self.max_batch_size < 0:
            raise ValueError(f"speculative max_batch_size must be >= 0, got {self.max_batch_size}")


@dataclass
class SpeculativeStats:
    num_drafts: int = 0  # sequence-steps that verified a draft
    num_draft_tokens: int = 0  # draft tokens proposed (and verified)
    num_accepted_tokens: int = 0  # of those, the ones the model kept
    drafting: bool = False  # whether the last step drafted (False while the adaptive switch is off)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens gained per verify step, the verified token after the accepted ones included (SGLang's
        "accept length"): 1 means no draft token was ever kept."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def accepted_prefix(draft: list[int], targets: list[int]) -> int:
    """How many leading draft tokens the model's own tokens at those positions confirm.

    ``targets[i]`` is the model's token after the last known token and ``draft[:i]``; ``len(targets)`` is
    ``len(draft) + 1``.
    """
    n = 0
    for proposed, chosen in zip(draft, targets, strict=False):
        if proposed != chosen:
            break
        n += 1
    return n


class MTPDrafter:
    """Runs the MTP layer after each engine step and leaves each decoding sequence's next draft in
    ``seq.draft`` (with blocks for its positions held)."""

    def __init__(
        self, model: Any, scheduler: Scheduler, config: SpeculativeConfig, device: torch.device
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.config = config
        self.device = device
        self.stats = SpeculativeStats()

    def active(self) -> bool:
        limit = self.config.max_batch_size
        return limit == 0 or len(self.scheduler.running) <= limit

    def draft_budget(self, seq: Sequence, max_model_len: int) -> int:
        """Draft tokens worth proposing for ``seq`` now: none past ``max_tokens`` or the context."""
        if seq.grammar is not None or seq.params.penalized or not seq.is_running:
            return 0
        left = seq.params.max_tokens - seq.num_output_tokens - 1
        return max(0, min(self.config.num_draft_tokens, left, max_model_len - seq.num_tokens))

    @torch.no_grad()
    def propose(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        starts: list[int],
        max_model_len: int,
    ) -> None:
        """After ``batch`` ran (``hidden``: its forward's final hidden states, flattened in batch order;
        ``meta``: that forward's attention metadata) and the scheduler advanced: fill the MTP cache for the
        step's positions and draft for the sequences that decode next.

        The MTP layer runs over exactly the forward's rows with the forward's own metadata (the same
        positions, slots and attention form), so no second metadata is built and the main hidden states
        are read in place: row ``p`` gets token ``p + 1`` where the sequence now knows it (the prompt's next
        token, or the token kept at ``p + 1``). Rows past what a step kept (rejected draft positions, the
        rows of a sequence that just finished) compute garbage in slots that are either free or rewritten
        before anything attends to them, as the main layers' rows for those positions already are.
        """
        ids: list[int] = []
        drafting: list[tuple[Sequence, int]] = []  # (sequence, its last kept row)
        offset = 0
        for i, seq in enumerate(batch.seqs):
            start, n = starts[i], batch.num_new_tokens[i]
            known = seq.token_ids
            nxt = known[start + 1 : start + n + 1]  # MTP row p reads token p + 1
            ids += nxt
            if len(nxt) < n:  # rows past the kept tokens: any valid id
                ids += [0] * (n - len(nxt))
            kept = seq.num_computed_tokens - start if seq.is_running else 0
            if kept > 0 and batch.sample[i]:
                drafting.append((seq, offset + kept - 1))
            offset += n
        model = self.model
        input_ids = torch.tensor(ids, dtype=torch.int64).to(hidden.device, non_blocking=True)
        with attention_context(meta):
            out = model.mtp_hidden(hidden, input_ids, meta.positions)
        # Draft only where blocks for the draft positions are free (after the MTP rows are written).
        sized = [(seq, row, self.scheduler.grow_for_draft(seq, self.draft_budget(seq, max_model_len)))
                 for seq, row in drafting]  # fmt: skip
        chain = [(seq, row, k) for seq, row, k in sized if k > 0]
        if not chain:
            return
        if len(chain) == out.shape[0]:
            last_rows = out
        else:
            last = torch.tensor([r for _, r, _ in chain], dtype=torch.int64)
            last_rows = out.index_select(0, last.to(out.device, non_blocking=True))
        normed, logits = model.mtp_head(last_rows)
        for (seq, _, _), t in zip(chain, logits.argmax(dim=-1).tolist(), strict=True):
            seq.draft = [t]
        # Chain: the MTP layer's own normed output stands in for the main model's hidden state.
        for depth in range(1, max(k for _, _, k in chain)):
            keep = [j for j, (_, _, k) in enumerate(chain) if k > depth]
            seqs = [chain[j][0] for j in keep]
            # The row for position num_tokens - 2 + depth reads the previous draft token.
            input_ids, step_meta = paged_metadata(
                [s.draft[-1] for s in seqs],
                [s.block_table for s in seqs],
                [s.num_tokens - 2 + depth for s in seqs],
                [1] * len(seqs),
                self.scheduler.block_size,
                self.device,
            )
            if len(keep) != len(chain):
                normed = normed.index_select(0, torch.tensor(keep, device=normed.device))
            with attention_context(step_meta):
                out = model.mtp_hidden(normed, input_ids, step_meta.positions)
            normed, logits = model.mtp_head(out)
            for s, t in zip(seqs, logits.argmax(dim=-1).tolist(), strict=True):
                s.draft.append(t)
            chain = [chain[j] for j in keep]
