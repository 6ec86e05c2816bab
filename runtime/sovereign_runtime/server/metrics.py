"""Prometheus metrics with the vLLM-compatible names pinned in docs/CONTRACTS.md.

Request-level histograms and token counters are observed by the server as outputs stream; engine gauges
(running/waiting requests, KV usage, prefix-cache counters) are read from the engine's ``EngineStats`` at
scrape time by a custom collector, so they are never stale. Each app gets its own registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.api import EngineStats
from ..read_deadlines import TIMEOUT_KINDS

STARTUP_PHASES = (
    "joining_group",
    "loading_weights",
    "compiling",
    "warming_up",
    "self_test",
    "ready",
    "failed",
)
FINISHED_REASONS = ("stop", "length", "abort", "error")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)  # fmt: skip

# Gauge and counter names -> the ``EngineStats`` field each reads, and its help text.
_GAUGES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "vllm:num_requests_waiting": ("num_requests_waiting", "Requests queued by admission control."),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage", "Fraction (0..1) of KV-cache blocks in use."),
    "vllm:gpu_cache_usage_perc": (
        "kv_cache_usage",
        "Fraction (0..1) of KV-cache blocks in use (vLLM's older name).",
    ),
    "sovereign:prompt_tokens_waiting": (
        "prompt_tokens_waiting",
        "Prompt tokens not yet prefilled (queued and partially prefilled).",
    ),
    "sovereign:spec_decode_requested": (
        "spec_decode_requested",
        "1 when the server was started with --speculative-algorithm.",
    ),
    "sovereign:spec_decode_enabled": (
        "spec_decode_enabled",
        "1 when MTP speculative decoding is in force (0: not requested, or the checkpoint has no MTP layer).",
    ),
    "sovereign:spec_decode_drafting": (
        "spec_decode_drafting",
        "1 while the last step drafted (0 while the running batch is above --speculative-max-batch-size).",
    ),
    "sovereign:spec_decode_num_draft_tokens": (
        "spec_decode_num_draft_tokens",
        "Draft tokens proposed per step (--speculative-num-draft-tokens).",
    ),
    "sovereign:spec_decode_acceptance_rate": (
        "spec_decode_acceptance_rate",
        "Accepted / proposed draft tokens since start.",
    ),
    "sovereign:spec_decode_mean_accept_length": (
        "spec_decode_mean_accept_length",
        "Tokens gained per verify step since start, the verified token included (1 + accepted / drafts).",
    ),
}
_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:prefix_cache_queries": (
        "prefix_cache_queries",
        "Prompt tokens looked up in the radix prefix cache.",
    ),
    "vllm:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the radix prefix cache."),
    "sovereign:spec_decode_num_drafts_total": (
        "spec_decode_num_drafts_total",
        "Sequence-steps that verified a draft.",
    ),
    "sovereign:spec_decode_num_draft_tokens_total": (
        "spec_decode_num_draft_tokens_total",
        "Draft tokens proposed by the MTP layer and verified.",
    ),
    "sovereign:spec_decode_num_accepted_tokens_total": (
        "spec_decode_num_accepted_tokens_total",
        "Draft tokens the model accepted.",
    ),
    "sovereign:nonfinite_logits_total": (
        "nonfinite_logits_total",
        "Requests ended with an error because their logits were not finite (NaN or infinity).",
    ),
    "sovereign:precision_fallbacks_total": (
        "precision_fallbacks_total",
        "Non-finite sequences recomputed once with FP8 weights dequantised to float32.",
    ),
    "sovereign:precision_fallbacks_recovered_total": (
        "precision_fallbacks_recovered_total",
        "Precision fallbacks whose float32 recompute was finite (the request continued).",
    ),
    "sovereign:degenerate_outputs_total": (
        "degenerate_outputs_total",
        "Requests ended with finish_reason error because their output repeated (repetition_window).",
    ),
    "sovereign:isolated_step_exceptions_total": (
        "isolated_exceptions_total",
        "Requests ended alone by an engine-step exception their inputs caused (the batch continued).",
    ),
}


class _EngineCollector(Collector):
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        phase: Callable[[], str],
        self_test: Callable[[], Mapping[str, Any] | None] | None = None,
        startup: Callable[[], Mapping[str, Any]] | None = None,
    ):
        self._model = model_name
        self._stats = stats
        self._phase = phase
        self._self_test = self_test
        self._startup = startup

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()  # None until the model is loaded: every engine figure reads 0

        def value(field: str) -> float:
            return 0.0 if stats is None else float(getattr(stats, field))

        for name, (field, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], value(field))
            yield g
        for name, (field, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], value(field))
            yield c
        queries, hits = value("prefix_cache_queries"), value("prefix_cache_hits")
        rate = GaugeMetricFamily(
            "sovereign:prefix_cache_hit_rate",
            "Prefix-cache hits / queries since start.",
            labels=["model_name"],
        )
        rate.add_metric([self._model], hits / queries if queries else 0.0)
        yield rate
        phase = GaugeMetricFamily(
            "sovereign:startup_phase", "1 for the current startup phase.", labels=["model_name", "phase"]
        )
        current = self._phase()
        for p in STARTUP_PHASES:
            phase.add_metric([self._model, p], 1.0 if p == current else 0.0)
        yield phase
        if self._startup is not None:
            yield from self._startup_metrics(self._startup())
        if self._self_test is not None:
            yield from self._self_test_metrics(self._self_test())

    def _startup_metrics(self, timing: Mapping[str, Any]) -> Iterator[Metric]:
        """How long each finished startup phase took, and the whole start (0 until ready)."""
        phases = GaugeMetricFamily(
            "sovereign:startup_phase_duration_seconds",
            "Seconds this process spent in a finished startup phase (process, loading_weights, compiling,"
            " warming_up, self_test).",
            labels=["model_name", "phase"],
        )
        for name, seconds in (timing.get("phase_seconds") or {}).items():
            phases.add_metric([self._model, name], float(seconds))
        yield phases
        total = GaugeMetricFamily(
            "sovereign:startup_duration_seconds",
            "Process start to ready, in seconds (0 until ready).",
            labels=["model_name"],
        )
        total.add_metric([self._model], float(timing.get("startup_seconds") or 0.0))
        yield total

    def _self_test_metrics(self, health: Mapping[str, Any] | None) -> Iterator[Metric]:
        """The output self-test (``ServerState.self_test_health``): last result, per check, run counts."""
        if not health:
            return
        m = self._model
        runs = CounterMetricFamily(
            "sovereign:self_test_runs", "Output self-tests run (startup and periodic).", labels=["model_name"]
        )
        runs.add_metric([m], float(health.get("runs", 0)))
        yield runs
        skipped = CounterMetricFamily(
            "sovereign:self_test_skipped",
            "Periodic self-tests skipped because real requests saturated the engine.",
            labels=["model_name"],
        )
        skipped.add_metric([m], float(health.get("skipped", 0)))
        yield skipped
        failures = CounterMetricFamily(
            "sovereign:self_test_failures",
            "Failed self-test checks, by check.",
            labels=["model_name", "check"],
        )
        for check, n in sorted((health.get("failures") or {}).items()):
            failures.add_metric([m, check], float(n))
        yield failures
        last = health.get("last")
        if not last:
            return
        passing = GaugeMetricFamily(
            "sovereign:self_test_passing",
            "1 while the last output self-test passed (/health/ready follows it), else 0.",
            labels=["model_name"],
        )
        passing.add_metric([m], 1.0 if last.get("passed") else 0.0)
        yield passing
        per_check = GaugeMetricFamily(
            "sovereign:self_test_check_passing",
            "1 per check of the last self-test that passed, 0 for the failing one.",
            labels=["model_name", "check"],
        )
        for c in last.get("checks", []):
            per_check.add_metric([m, str(c.get("name"))], 1.0 if c.get("passed") else 0.0)
        yield per_check
        duration = GaugeMetricFamily(
            "sovereign:self_test_duration_seconds", "Duration of the last self-test.", labels=["model_name"]
        )
        duration.add_metric([m], float(last.get("duration_s", 0.0)))
        yield duration


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        phase: Callable[[], str],
        self_test: Callable[[], Mapping[str, Any] | None] | None = None,
        startup: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival to first token.",
            labels,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Gap between consecutive output tokens.",
            labels,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Gap between consecutive output tokens (vLLM's older name).",
            labels,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", labels, registry=r, buckets=_E2E_BUCKETS
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=r
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success", "Finished requests.", ["model_name", "finished_reason"], registry=r
        )
        for reason in FINISHED_REASONS:
            self._success.labels(model_name, reason)
        # Requests refused for load (429): load the autoscaler should see, though they never ran.
        self.rejected = Counter(
            "sovereign:requests_rejected",
            "Requests refused for load, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.rejected.labels(model_name, "queue_full")
        # Connections closed because a client sent its headers or body too slowly (slowloris).
        self.read_timeouts = Counter(
            "sovereign:request_read_timeouts",
            "Requests or connections closed because the client sent headers or body too slowly.",
            ["kind"],
            registry=r,
        )
        for kind in TIMEOUT_KINDS:
            self.read_timeouts.labels(kind)
        r.register(_EngineCollector(model_name, stats, phase, self_test, startup))

    def observe_token_gap(self, seconds: float, tokens: int) -> None:
        # A step that returns k tokens at once (e.g. speculative decoding) counts k equal gaps.
        per = seconds / max(tokens, 1)
        for _ in range(max(tokens, 1)):
            self.itl.observe(per)
            self.tpot.observe(per)

    def observe_finish(
        self, reason: str, prompt_tokens: int, completion_tokens: int, e2e_seconds: float
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self._success.labels(self.model_name, reason if reason in FINISHED_REASONS else "abort").inc()
        self.e2e.observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
