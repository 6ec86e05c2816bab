"""``LLMEngine``: the synchronous engine (add requests, ``step()`` until idle).

``AsyncEngine`` (``async_engine.py``) runs it on a background thread for asyncio callers; the decode side of
disaggregation (``remote_prefill.py``) drives its reserved-prompt path. Timestamps are ``time.monotonic()``
seconds: subtract them, never compare them with wall-clock time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..model import load_model
from .api import EngineStats, InvalidRequest, RequestFailed, RequestOutput, TokenLogprob
from .block_manager import KVLayout, plan_num_blocks
from .grammar import accept
from .guard import SequenceFailure, StepGuard, rows_by_sequence
from .model_runner import ModelRunner, PagedModel
from .repetition import RepetitionDetector
from .sampler import SamplerOutput, make_generator
from .sampling import SamplingParams
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, ScheduledBatch, Scheduler, SchedulerConfig
from .sequence import Sequence
from .speculative import MTPDrafter, SpeculativeConfig, accepted_prefix


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # KV capacity (see plan_num_blocks): explicit block count, or GiB, or a fraction of free memory.
    num_kv_blocks: int | None = None
    kv_cache_gib: float | None = None
    kv_memory_fraction: float | None = None
    device: str = "cpu"
    dtype: torch.dtype | None = None  # default: the model's parameter dtype
    # MTP speculative decoding (engine/speculative.py); None: one token per step.
    speculative: SpeculativeConfig | None = None


# Prefill-side KV export of one request: ``hook(seq, layer, start, end)`` (see ``LLMEngine.kv_export_hooks``).
KVExportHook = Callable[[Sequence, int, int, int], None]


class _LayerExport:
    """One step's per-layer export: the model calls it after each decoder layer (``after_layer``).

    Built only for batches holding an exported sequence. A hook that raises is dropped from the engine's
    hooks and from the rest of this step: a broken transfer fails that request's transfer, never the batch.
    """

    def __init__(
        self,
        hooks: dict[str, KVExportHook],
        targets: list[tuple[Sequence, KVExportHook, int, int]],
        layers: int,
        exported: dict[str, int] | None = None,
    ) -> None:
        self.hooks, self.targets, self.layers = hooks, targets, layers
        self.next_layer = 0
        # request id -> layers already exported in this engine step: when the output guard re-runs part
        # of a step (an exception bisected, a float32 recompute), a layer is never sent twice.
        self.exported = exported if exported is not None else {}

    @classmethod
    def for_batch(
        cls, engine: LLMEngine, batch: ScheduledBatch, exported: dict[str, int] | None = None
    ) -> _LayerExport | None:
        hooks = engine.kv_export_hooks
        targets = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            hook = hooks.get(seq.request_id)
            if hook is not None:
                # Positions this step writes; read before ``update`` advances num_computed_tokens.
                targets.append((seq, hook, seq.num_computed_tokens, seq.num_computed_tokens + n))
        # Only the decoder layers are exported: the MTP layer's rows are the decode side's own to compute.
        return cls(hooks, targets, engine.num_transfer_layers, exported) if targets else None

    def __call__(self, layer: int) -> None:
        if layer >= self.layers:
            return
        for target in list(self.targets):
            seq, hook, start, end = target
            if layer < self.exported.get(seq.request_id, 0):
                continue
            try:
                hook(seq, layer, start, end)
                self.exported[seq.request_id] = layer + 1
            except Exception:
                self.targets.remove(target)
                self.hooks.pop(seq.request_id, None)
        self.next_layer = max(self.next_layer, layer + 1)

    def finish(self) -> None:
        """Export the layers the model did not report (a model that ignores ``after_layer``)."""
        for layer in range(self.next_layer, self.layers):
            self(layer)


class LLMEngine:
    """Synchronous engine: ``add_request``, then ``step()`` until ``has_unfinished()`` is False."""

    def __init__(
        self,
        model: PagedModel,
        *,
        num_layers: int,
        kv_cache_dim: int,
        max_position_embeddings: int,
        vocab_size: int,
        eos_token_ids: set[int] | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        self.vocab_size = vocab_size
        self.device = torch.device(cfg.device)
        dtype = cfg.dtype or _activation_dtype(model)
        max_model_len = cfg.max_model_len or max_position_embeddings
        # Decoder layers: what a forward writes and what disaggregation transfers; speculation adds the
        # MTP layer's own pages after them.
        self.num_transfer_layers = num_layers
        if cfg.speculative is not None:
            num_layers += 1
        # A pipeline-parallel leader keeps only its stage's layers; the pool is sized so that the stage
        # holding the most layers fits.
        split = getattr(model, "kv_cache_layers", None)
        local_layers, widest = split(num_layers) if split is not None else (num_layers, num_layers)
        layout = KVLayout(widest, cfg.block_size, kv_cache_dim, dtype)
        # More blocks than max_num_seqs full contexts (twice, for the prefix cache) is wasted host RAM.
        useful = 2 * cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
        num_blocks = plan_num_blocks(
            layout,
            self.device,
            num_kv_blocks=cfg.num_kv_blocks,
            kv_cache_gib=cfg.kv_cache_gib,
            memory_fraction=cfg.kv_memory_fraction,
            max_useful_blocks=useful,
        )
        self.layout = layout
        # A request must fit the pool on its own (else it would preempt itself forever): cap the context.
        max_model_len = min(max_model_len, num_blocks * cfg.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_prefix_caching=cfg.enable_prefix_caching,
            ),
            num_blocks,
            eos_token_ids=eos_token_ids,
        )
        self.runner = ModelRunner(
            model,
            num_layers=local_layers,
            kv_cache_dim=kv_cache_dim,
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            device=self.device,
            dtype=dtype,
        )
        self.max_model_len = max_model_len
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Prefill side of disaggregation: request id -> ``hook(seq, layer, start, end)``, called on the
        # engine thread during each forward that computes part of that request, right after decoder layer
        # ``layer`` wrote the KV of positions ``[start, end)`` (copy the rows out before returning: the
        # next step may overwrite them). Set and cleared by sovereign_runtime.disagg.
        self.kv_export_hooks: dict[str, KVExportHook] = {}
        # The output guard (engine/guard.py): finite logits per sequence, one request's failure its own.
        self.guard = StepGuard(model, dtype)
        self._guard_on = True
        self.drafter = (
            MTPDrafter(model, self.scheduler, cfg.speculative, self.device)
            if cfg.speculative is not None
            else None
        )
        # Set by the assembly when speculation was asked for and the checkpoint cannot: why.
        self.speculative_unavailable: str | None = None

    @property
    def transfer_kv_cache(self) -> Any:
        """The decoder layers' part of the KV cache (a view): what a prefill instance sends and a decode
        instance receives. The MTP layer's pages after it stay each instance's own. When the layers span
        pipeline stages, the leader's ``StagedKVCache`` (rows move through it) instead of a tensor."""
        staged = getattr(self.runner.model, "transfer_cache", None)
        view = staged(self.num_transfer_layers) if staged is not None else None
        return view if view is not None else self.runner.kv_cache[: self.num_transfer_layers]

    @classmethod
    def from_model(cls, model: Any, config: EngineConfig | None = None) -> LLMEngine:
        """Build around a loaded ``sovereign_runtime.model`` model (reads its ``config``)."""
        mc = model.config
        eos = mc.eos_token_id
        eos_ids = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        if config is not None and config.speculative is not None and not _mtp_layers(model):
            raise ValueError(
                "speculative decoding with mtp needs the checkpoint's MTP layer: "
                + (
                    getattr(model, "mtp_unavailable", None)
                    or "config.json declares num_nextn_predict_layers 0"
                )
            )
        return cls(
            model,
            num_layers=mc.num_hidden_layers,
            kv_cache_dim=mc.kv_lora_rank + mc.qk_rope_head_dim,
            max_position_embeddings=mc.max_position_embeddings,
            vocab_size=mc.vocab_size,
            eos_token_ids=eos_ids,
            config=config,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        cfg = config or EngineConfig()
        model, _ = load_model(path, cfg.device, cfg.dtype)
        return cls.from_model(model, cfg)

    # ---- requests -----------------------------------------------------------------------------------
    def make_sequence(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Validate a request without touching engine state (safe from any thread)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        params.validate()
        if not prompt_token_ids:
            raise InvalidRequest("prompt", "must contain at least one token")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequest("prompt", f"token ids must be in [0, {self.vocab_size})")
        params.check_vocab(self.vocab_size)
        seq = Sequence(request_id or uuid.uuid4().hex, list(prompt_token_ids), len(prompt_token_ids), params)
        seq.generator = make_generator(params.seed, self.device)
        if params.repetition_window:
            seq.repetition = RepetitionDetector(params.repetition_window)
        if params.json_schema is not None:
            grammars = self.runner.grammars
            if grammars is None:
                raise InvalidRequest("json_schema", "needs an engine built with its tokenizer's grammars")
            seq.grammar = grammars.matcher(params.json_schema)
        self.scheduler.check_request(seq)
        return seq

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        seq = self.make_sequence(prompt_token_ids, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def add_sequence(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        return None if seq is None else self.request_output(seq, [], None, time.monotonic())

    def abort_all(self) -> list[str]:
        """Abort every request the engine holds (queued, running or reserved); returns their ids."""
        ids = list(self.scheduler.requests)
        for rid in ids:
            self.scheduler.abort(rid)
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- the loop -----------------------------------------------------------------------------------
    def set_output_guard(self, enabled: bool) -> None:
        """Turn the output guard off (True: on, the default). Only for measuring what it costs
        (bench/output_guard.py): off, non-finite logits are sampled and an exception fails the batch."""
        self._guard_on = enabled
        self.runner.sampler.check_finite = enabled

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns an output per sequence that got tokens (several
        when it verified a draft), and a finished one (``finish_reason`` "error", ``error`` set) per
        sequence the guard failed."""
        sched = self.scheduler
        batch = sched.schedule()
        if not batch.seqs:
            return []
        # Counted before the model runs: ``update`` advances num_computed_tokens.
        self.prompt_tokens_total += sum(
            min(n, s.num_prompt_tokens - s.num_computed_tokens)
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if s.num_computed_tokens < s.num_prompt_tokens
        )
        starts = [s.num_computed_tokens for s in batch.seqs]
        rewind = _generator_states(batch)
        exported: dict[str, int] = {}

        def run(part: ScheduledBatch) -> SamplerOutput:
            export = _LayerExport.for_batch(self, part, exported) if self.kv_export_hooks else None
            out = self.runner.execute(part, export)
            if export is not None:
                export.finish()  # layers the model did not report (a model without the callback)
            return out

        if self._guard_on:
            guarded = self.guard.execute(batch, run)
            out, failures = guarded.out, guarded.failures
        else:
            out, failures = run(batch), {}
        now = time.monotonic()
        outputs = [self._fail(seq, failure, now) for seq, failure in failures.items()]
        if batch.drafts is None:
            # One token per sampled sequence (the common path, no speculation this step).
            sched.update(batch, out.token_ids, now)
            sampled = [s for s, x in zip(batch.seqs, batch.sample, strict=True) if x]
            for i, seq in enumerate(sampled):
                if seq in failures:
                    continue
                if seq.grammar is not None and not self.advance_grammar(seq, out.token_ids[i]):
                    outputs.append(self.refuse_grammar_token(seq, out.token_ids[i], now))
                    continue
                lp = out.logprobs[i]
                logprob = (
                    None if lp is None else TokenLogprob(out.token_ids[i], lp, out.top_logprobs[i] or [])
                )
                outputs.append(self.token_output(seq, out.token_ids[i], logprob, now))
        else:
            outputs += self._verified(batch, out, failures, rewind, now)
        self._draft(batch, starts)
        return outputs

    def _verified(
        self,
        batch: ScheduledBatch,
        out: SamplerOutput,
        failures: dict[Sequence, SequenceFailure],
        rewind: dict[Sequence, torch.Tensor],
        now: float,
    ) -> list[RequestOutput]:
        """Keep each sequence's draft tokens up to the first the model did not pick, then that pick."""
        rows = rows_by_sequence(batch, out)
        kept: list[list[int]] = []
        logprobs: dict[Sequence, list[TokenLogprob | None]] = {}
        stats = self.drafter.stats if self.drafter is not None else None
        for i, seq in enumerate(batch.seqs):
            if not batch.sample[i]:
                continue
            tokens, lps, tops = rows[seq]
            draft = batch.draft(i)
            n = accepted_prefix(draft, tokens) + 1 if seq not in failures else len(tokens)
            kept.append(tokens[:n])
            logprobs[seq] = [
                None if lp is None else TokenLogprob(t, lp, top or [])
                for t, lp, top in zip(tokens[:n], lps[:n], tops[:n], strict=True)
            ]
            if draft and seq not in failures:
                seq.num_verify_steps += 1
                seq.num_draft_tokens += len(draft)
                seq.num_accepted_tokens += n - 1
                if stats is not None:
                    stats.num_drafts += 1
                    stats.num_draft_tokens += len(draft)
                    stats.num_accepted_tokens += n - 1
            state = rewind.get(seq)
            if state is not None:  # leave the generator where drawing exactly the kept tokens leaves it
                assert seq.generator is not None
                seq.generator.set_state(state)
                for _ in range(n):
                    self.runner.sampler.skip_token(seq.params, seq.generator, self.vocab_size)
        before = {seq: seq.num_tokens for seq in logprobs}
        self.scheduler.update_tokens(batch, kept, now)
        outputs: list[RequestOutput] = []
        for seq, lps in logprobs.items():
            if seq in failures:
                continue
            new = seq.token_ids[before[seq] :]
            if not new:  # aborted while the step ran
                continue
            # A grammar's sequence is never drafted: exactly one token.
            if seq.grammar is not None and not self.advance_grammar(seq, new[0]):
                outputs.append(self.refuse_grammar_token(seq, new[0], now))
                continue
            self.generation_tokens_total += len(new)
            asked = seq.params.logprobs is not None
            lp = [x for x in lps[: len(new)] if x is not None] if asked else None
            outputs.append(self.request_output(seq, new, lp, now))
        return outputs

    def _draft(self, batch: ScheduledBatch, starts: list[int]) -> None:
        """Run the MTP layer over this step's kept positions and draft for the next step."""
        drafter = self.drafter
        if drafter is None:
            return
        forward = self.runner.last_forward
        self.runner.last_forward = None
        drafter.stats.drafting = drafter.active()
        # After a guarded retry the last forward is a part of the batch: skip drafting for one step.
        if not drafter.stats.drafting or forward is None or forward[0] is not batch:
            return
        drafter.propose(batch, forward[1], forward[2], starts, self.max_model_len)

    def advance_grammar(self, seq: Sequence, token: int) -> bool:
        """Feed ``seq``'s new token to its grammar; False if the grammar refuses it."""
        return accept(seq.grammar, token)

    def refuse_grammar_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        # A sampled token outside the mask (a bug), or a first token from a prefill that did not
        # constrain it: end the request rather than return output that breaks its schema.
        return self._fail(
            seq,
            SequenceFailure("grammar", f"token {token} does not continue the response_format's schema"),
            now,
        )

    def _fail(self, seq: Sequence, failure: SequenceFailure, now: float) -> RequestOutput:
        """End ``seq`` with an error: blocks freed, nothing cached from it, no token."""
        self.scheduler.abort(seq.request_id, reason="error")
        out = self.request_output(seq, [], None, now)
        out.error = RequestFailed(failure.kind, failure.message)
        return out

    def token_output(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        """``seq`` gained ``token`` (already appended by the scheduler): count it, build its output."""
        self.generation_tokens_total += 1
        lp = [logprob] if logprob is not None and seq.params.logprobs is not None else None
        return self.request_output(seq, [token], lp, now)

    def request_output(
        self, seq: Sequence, new: list[int], lp: list[TokenLogprob] | None, now: float
    ) -> RequestOutput:
        """``seq``'s output now, with ``new`` its tokens since the last one."""
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            new_logprobs=lp,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            time=now,
            spec_verify_steps=seq.num_verify_steps,
            spec_draft_tokens=seq.num_draft_tokens,
            spec_accepted_tokens=seq.num_accepted_tokens,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Convenience for tests and scripts: run prompts to completion, return the output token ids."""
        ids = [self.add_request(p, params) for p in prompts]
        result: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                result[o.request_id] += o.new_token_ids
        return [result[i] for i in ids]

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        cache = self.scheduler.cache
        return EngineStats(
            **vars(s),
            prefix_cache_hit_rate=cache.hit_rate if cache is not None else 0.0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_blocks=self.scheduler.pool.num_blocks,
            block_size=self.scheduler.block_size,
            nonfinite_logits_total=self.guard.stats.nonfinite_logits_total,
            precision_fallbacks_total=self.guard.stats.precision_fallbacks_total,
            precision_fallbacks_recovered_total=self.guard.stats.precision_fallbacks_recovered_total,
            isolated_exceptions_total=self.guard.stats.isolated_exceptions_total,
            degenerate_outputs_total=self.scheduler.num_degenerate,
            **self._speculative_stats(),
        )

    def _speculative_stats(self) -> dict[str, Any]:
        d = self.drafter
        if d is None:
            return {"spec_decode_requested": self.speculative_unavailable is not None}
        return {
            "spec_decode_requested": True,
            "spec_decode_enabled": True,
            "spec_decode_drafting": d.stats.drafting,
            "spec_decode_num_draft_tokens": d.config.num_draft_tokens,
            "spec_decode_num_drafts_total": d.stats.num_drafts,
            "spec_decode_num_draft_tokens_total": d.stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": d.stats.num_accepted_tokens,
            "spec_decode_acceptance_rate": d.stats.acceptance_rate,
            "spec_decode_mean_accept_length": d.stats.mean_accept_length,
        }


def _mtp_layers(model: Any) -> int:
    inner = getattr(model, "model", model)  # a tensor-parallel leader wraps its shard
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        mtp = getattr(inner, "mtp", None)
    return len(mtp) if mtp is not None else 0


def _generator_states(batch: ScheduledBatch) -> dict[Sequence, torch.Tensor]:
    """Generator states of the seeded, sampled sequences verifying a draft, before the step draws."""
    if batch.drafts is None:
        return {}
    return {
        seq: seq.generator.get_state()
        for i, seq in enumerate(batch.seqs)
        if batch.draft(i) and seq.generator is not None and not seq.params.greedy
    }


def _activation_dtype(model: Any) -> torch.dtype:
    """The model's compute dtype: its first 16/32-bit float parameter (FP8 weights do not count)."""
    for p in model.parameters():
        if p.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return p.dtype
    return torch.float32
