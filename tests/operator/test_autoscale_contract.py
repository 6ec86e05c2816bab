"""Contract: what the runtime's /metrics renders is what the autoscaler parses (docs/CONTRACTS.md)."""

from __future__ import annotations

from typing import Any

import pytest
from sovereign_operator.autoscale.metrics import aggregate_pool, parse_pod_metrics

server_metrics = pytest.importorskip("sovereign_runtime.server.metrics")
engine_api = pytest.importorskip("sovereign_runtime.engine.api")


def test_runtime_metrics_feed_the_autoscaler() -> None:
    stats: Any = engine_api.EngineStats(
        num_requests_running=5,
        num_requests_waiting=2,
        kv_cache_usage=0.625,
        num_free_blocks=6,
        num_cached_blocks=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        prompt_tokens_waiting=3000,
        num_preemptions=0,
    )
    m = server_metrics.ServerMetrics("tiny", lambda: stats, lambda: "ready")
    for _ in range(100):
        m.ttft.observe(0.03)  # a fast history
        m.observe_token_gap(0.01, 1)
    m.observe_finish("stop", 1000, 10, 0.5)
    before = parse_pod_metrics(m.render().decode(), "http://pod-0:8000/metrics", 0.0)
    assert (before.running, before.waiting, before.kv_usage, before.prompt_tokens_waiting) == (
        5,
        2,
        0.625,
        3000,
    )
    assert before.prompt_tokens_total == 1000
    assert before.ttft is not None and before.ttft.count == 100
    assert before.itl is not None and before.itl.count == 100

    # A slow interval: the autoscaler sees it, not the lifetime average.
    for _ in range(10):
        m.ttft.observe(3.0)
        m.observe_token_gap(0.2, 1)
    m.observe_finish("stop", 2000, 10, 5.0)
    after = parse_pod_metrics(m.render().decode(), "http://pod-0:8000/metrics", 15.0)
    pool = aggregate_pool({after.url: after}, {before.url: before}, pods_expected=1, now=15.0)
    assert pool.ttft_seconds is not None and 2.5 <= pool.ttft_seconds <= 5.0
    assert pool.itl_seconds is not None and 0.1 <= pool.itl_seconds <= 0.25
    assert pool.prompt_tokens_per_s == pytest.approx(2000 / 15)
    assert pool.kv_cache_usage_mean == 0.625 and pool.requests_running == 5
