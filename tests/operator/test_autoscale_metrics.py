"""Metric collection: parsing, histogram windows, pod scraping and the Prometheus API source."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from loopback import serve_app
from sovereign_operator.autoscale.metrics import (
    Histogram,
    PodScraper,
    aggregate_pool,
    histogram_quantile,
    parse_pod_metrics,
    prometheus_queries,
    query_prometheus_pool,
)

BOUNDS = (0.1, 0.5, 1.0, 5.0)


def runtime_text(
    *,
    running: float = 0.0,
    waiting: float = 0.0,
    kv: float = 0.0,
    backlog: float = 0.0,
    prompt_total: float = 0.0,
    rejected: float = 0.0,
    ttft: dict[float, float] | None = None,
    itl: dict[float, float] | None = None,
    models: tuple[str, ...] = ("m",),
) -> str:
    """What a runtime pod serves; histogram arguments are per-bucket (not cumulative) counts."""
    lines: list[str] = []
    for name, kind in (
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("sovereign:prompt_tokens_waiting", "gauge"),
        ("vllm:prompt_tokens", "counter"),
        ("sovereign:requests_rejected", "counter"),
    ):
        lines.append(f"# TYPE {name} {kind}")
    values = {
        "vllm:num_requests_running": running,
        "vllm:num_requests_waiting": waiting,
        "vllm:kv_cache_usage_perc": kv,
        "sovereign:prompt_tokens_waiting": backlog,
        "vllm:prompt_tokens_total": prompt_total,
        "sovereign:requests_rejected_total": rejected,
    }
    for model in models:
        for name, v in values.items():
            share = v if name == "vllm:kv_cache_usage_perc" else v / len(models)
            lines.append(f'{name}{{model_name="{model}"}} {share}')
    for name, counts in (
        ("vllm:time_to_first_token_seconds", ttft or {}),
        ("vllm:inter_token_latency_seconds", itl or {}),
    ):
        lines.append(f"# TYPE {name} histogram")
        cumulative = 0.0
        total = 0.0
        for le in (*BOUNDS, float("inf")):
            cumulative += counts.get(le, 0.0)
            total += counts.get(le, 0.0) * (le if le != float("inf") else 10.0)
            label = "+Inf" if le == float("inf") else str(le)
            lines.append(f'{name}_bucket{{model_name="{models[0]}",le="{label}"}} {cumulative}')
        lines.append(f'{name}_count{{model_name="{models[0]}"}} {cumulative}')
        lines.append(f'{name}_sum{{model_name="{models[0]}"}} {total}')
    return "\n".join(lines) + "\n"


def test_parse_sums_label_sets_and_reads_histograms() -> None:
    text = runtime_text(
        running=4, waiting=2, kv=0.5, backlog=1000, prompt_total=50, ttft={0.5: 3}, models=("a", "b")
    )
    s = parse_pod_metrics(text, "http://p/metrics", 10.0)
    assert (s.running, s.waiting, s.prompt_tokens_waiting, s.prompt_tokens_total) == (4, 2, 1000, 50)
    assert s.kv_usage == pytest.approx(1.0)  # two label sets of 0.5 summed: one pod serves one model
    assert s.ttft is not None and s.ttft.count == 3 and dict(s.ttft.buckets)[0.5] == 3
    with pytest.raises(ValueError, match="not a Sovereign runtime"):
        parse_pod_metrics("other_metric 1\n", "http://p/metrics", 0.0)


def test_kv_usage_falls_back_to_the_older_name() -> None:
    text = 'vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
    assert parse_pod_metrics(text, "u", 0).kv_usage == 0.25


def test_histogram_quantile_interpolates_like_promql() -> None:
    h = Histogram(buckets=((0.1, 10), (0.5, 60), (1.0, 90), (float("inf"), 100)), count=100, total=50)
    assert histogram_quantile(0.9, h) == pytest.approx(1.0)
    assert histogram_quantile(0.5, h) == pytest.approx(0.1 + 0.4 * 40 / 50)
    assert histogram_quantile(0.05, h) == pytest.approx(0.05)
    # Beyond the last finite bound Prometheus answers that bound.
    assert histogram_quantile(0.99, h) == pytest.approx(1.0)
    assert histogram_quantile(0.9, Histogram(((1.0, 0), (float("inf"), 0)), 0, 0)) is None


def test_latency_comes_from_the_window_not_the_lifetime() -> None:
    # A long fast history, then a slow interval: the window's p90 must be slow.
    before = parse_pod_metrics(runtime_text(ttft={0.1: 1000}), "u", 0.0)
    after = parse_pod_metrics(runtime_text(ttft={0.1: 1000, 5.0: 20}), "u", 15.0)
    pool = aggregate_pool({"u": after}, {"u": before}, pods_expected=1, now=15.0)
    assert pool.ttft_seconds is not None and pool.ttft_seconds > 1.0
    lifetime = histogram_quantile(0.9, after.ttft)
    assert lifetime is not None and lifetime <= 0.1
    # A restarted pod (counts went down) contributes its whole new life.
    restarted = parse_pod_metrics(runtime_text(ttft={0.5: 4}), "u", 30.0)
    pool = aggregate_pool({"u": restarted}, {"u": after}, pods_expected=1, now=30.0)
    assert pool.ttft_seconds is not None and 0.1 < pool.ttft_seconds <= 0.5
    # No previous sample: gauges yes, latency only from the second round.
    first = aggregate_pool({"u": after}, {}, pods_expected=1, now=15.0)
    assert first.ttft_seconds is None and first.pods_reporting == 1


def test_aggregate_sums_queues_and_averages_kv() -> None:
    a0 = parse_pod_metrics(runtime_text(prompt_total=0), "a", 0.0)
    b0 = parse_pod_metrics(runtime_text(prompt_total=0), "b", 0.0)
    a = parse_pod_metrics(
        runtime_text(running=3, waiting=1, kv=0.2, backlog=500, prompt_total=1500), "a", 15.0
    )
    b = parse_pod_metrics(
        runtime_text(running=5, waiting=0, kv=0.6, backlog=100, prompt_total=3000), "b", 15.0
    )
    pool = aggregate_pool({"a": a, "b": b}, {"a": a0, "b": b0}, pods_expected=3, now=16.0, quantile=None)
    assert (pool.requests_running, pool.requests_waiting, pool.prompt_tokens_waiting) == (8, 1, 600)
    assert pool.kv_cache_usage_mean == pytest.approx(0.4) and pool.kv_cache_usage_max == pytest.approx(0.6)
    assert pool.prompt_tokens_per_s == pytest.approx(300.0)
    assert (pool.pods_reporting, pool.pods_expected, pool.observed_at) == (2, 3, 15.0)


def test_requests_refused_for_load_count_as_waiting() -> None:
    # A full queue answers 429 and its gauge stays at the cap: the refusals are the demand it hides.
    a0 = parse_pod_metrics(runtime_text(waiting=4, rejected=0), "a", 0.0)
    b0 = parse_pod_metrics(runtime_text(waiting=4, rejected=10), "b", 0.0)
    a = parse_pod_metrics(runtime_text(waiting=4, rejected=7), "a", 15.0)
    b = parse_pod_metrics(runtime_text(waiting=4, rejected=4), "b", 15.0)  # b restarted meanwhile
    pool = aggregate_pool({"a": a, "b": b}, {"a": a0, "b": b0}, pods_expected=2, now=16.0)
    assert pool.requests_rejected == 11 and pool.requests_waiting == 8 + 11
    first = aggregate_pool(
        {"a": a0}, {}, pods_expected=1, now=1.0
    )  # a first round has no window: nothing counted
    assert first.requests_rejected == 0 and first.requests_waiting == 4


@asynccontextmanager
async def serve(
    routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]],
) -> AsyncIterator[str]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    async with serve_app(app) as url:
        yield url


def test_scraper_aggregates_pods_and_reports_failures() -> None:
    state = {"slow_ttft": 0.0}

    async def fast(_: web.Request) -> web.Response:
        return web.Response(text=runtime_text(running=2, kv=0.5, ttft={0.1: 100, 5.0: state["slow_ttft"]}))

    async def other(_: web.Request) -> web.Response:
        return web.Response(text=runtime_text(running=1, waiting=3, kv=0.7))

    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.Response(text="")

    async def broken(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def main() -> None:
        clock = iter(float(i) for i in range(100))
        scraper = PodScraper(timeout_s=0.3, clock=lambda: next(clock))
        async with serve({"/a": fast, "/b": other, "/hang": hang, "/broken": broken}) as base:
            urls = [f"{base}/a", f"{base}/b", f"{base}/hang", f"{base}/broken"]
            async with aiohttp.ClientSession() as session:
                first = await scraper.scrape_pool(session, "ns/x/decode", urls)
                state["slow_ttft"] = 50.0
                second = await scraper.scrape_pool(session, "ns/x/decode", urls)
        assert (first.pods_reporting, first.pods_expected) == (2, 4)
        assert first.requests_running == 3 and first.requests_waiting == 3
        assert first.kv_cache_usage_mean == pytest.approx(0.6)
        assert first.ttft_seconds is None  # a first round has no window
        assert any("timed out" in e for e in first.errors) and any("HTTP 500" in e for e in first.errors)
        # The second window saw only the 50 slow requests.
        assert second.ttft_seconds is not None and second.ttft_seconds > 1.0

    asyncio.run(main())


def test_prometheus_source_runs_the_pool_queries() -> None:
    selector = 'namespace="llm",pod=~"v3-decode-[0-9]+"'
    q = prometheus_queries(selector, 60, 0.9)
    answers = {
        q["pods"]: 2,
        q["sample_time"]: 990.0,
        q["running"]: 12,
        q["waiting"]: 3,
        q["prompt_tokens_waiting"]: 4096,
        q["kv_mean"]: 0.55,
        q["kv_max"]: 0.8,
        q["ttft"]: float("nan"),  # no requests in the window
        q["itl"]: 0.04,
        q["prompt_tokens_per_s"]: 900,
        q["rejected"]: 5,
    }
    seen: list[str] = []

    async def api(request: web.Request) -> web.Response:
        query = request.query["query"]
        seen.append(query)
        if query not in answers:
            return web.json_response({"status": "success", "data": {"resultType": "vector", "result": []}})
        value = answers[query]
        result = [{"metric": {}, "value": [1000.0, "NaN" if value != value else str(value)]}]
        return web.Response(
            text=json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}),
            content_type="application/json",
        )

    async def main() -> None:
        async with serve({"/api/v1/query": api}) as base, aiohttp.ClientSession() as session:
            pool = await query_prometheus_pool(session, base, selector, pods_expected=2, window_s=60)
            missing = await query_prometheus_pool(session, base, 'pod="nope"', pods_expected=2, window_s=60)
        assert (pool.pods_reporting, pool.requests_running, pool.requests_waiting) == (2, 12, 3 + 5)
        assert pool.requests_rejected == 5 and "increase(sovereign:requests_rejected_total" in q["rejected"]
        assert pool.observed_at == 990.0 and pool.prompt_tokens_per_s == 900
        assert pool.kv_cache_usage_mean == 0.55 and pool.itl_seconds == 0.04 and pool.ttft_seconds is None
        assert any("histogram_quantile(0.9" in s and "[60s]" in s for s in seen)
        assert missing.pods_reporting == 0 and "no series" in missing.errors[0]

    asyncio.run(main())


def test_prometheus_unreachable_is_reported_not_raised() -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            # Port 9 on loopback: nothing listens; the connection is refused at once.
            pool = await query_prometheus_pool(
                session, "http://127.0.0.1:9", 'pod="x"', pods_expected=1, window_s=30, timeout_s=1
            )
        assert pool.pods_reporting == 0 and "prometheus" in pool.errors[0]

    asyncio.run(main())
