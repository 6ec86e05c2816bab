"""Collecting a pool's runtime metrics: from the pods' ``/metrics`` or from a Prometheus HTTP API.

The parsing and aggregation are pure (text -> PodSample -> PoolMetrics); the two collectors are thin
async shells around them. Latencies come from histogram *deltas* between two observations, so they
describe the last interval, not the process's lifetime.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .types import PoolMetrics

# Names from docs/CONTRACTS.md; the second of each pair is vLLM's older spelling.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PROMPT_BACKLOG = "sovereign:prompt_tokens_waiting"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
# Requests a worker refused for load (429, its waiting queue full): demand that waits elsewhere.
REJECTED_TOTAL = "sovereign:requests_rejected_total"
TTFT = "vllm:time_to_first_token_seconds"
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets (upper bound, count) sorted by bound, ending with +Inf."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    def minus(self, earlier: Histogram | None) -> Histogram:
        """Observations since `earlier`; a counter reset (process restart) keeps this one whole."""
        if earlier is None or earlier.count > self.count:
            return self
        before = dict(earlier.buckets)
        return Histogram(
            buckets=tuple((le, c - before.get(le, 0.0)) for le, c in self.buckets),
            count=self.count - earlier.count,
            total=self.total - earlier.total,
        )


def merge_histograms(hists: Iterable[Histogram]) -> Histogram | None:
    """Sum histograms bucket by bucket (pods of one pool share bucket bounds)."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    seen = False
    for h in hists:
        seen = True
        for le, c in h.buckets:
            buckets[le] = buckets.get(le, 0.0) + c
        count += h.count
        total += h.total
    if not seen:
        return None
    return Histogram(tuple(sorted(buckets.items())), count, total)


def histogram_quantile(q: float, hist: Histogram | None) -> float | None:
    """Like PromQL's histogram_quantile: linear interpolation inside the bucket holding rank q*count.

    None when the histogram saw no observations (no request in the window: idle, not missing).
    """
    if hist is None or hist.count <= 0 or not hist.buckets:
        return None
    rank = q * hist.count
    lower, below = 0.0, 0.0
    for le, cumulative in hist.buckets:
        if cumulative >= rank:
            if math.isinf(le):
                return lower  # the best bound we have, as Prometheus does
            in_bucket = cumulative - below
            if in_bucket <= 0:
                return le
            return lower + (le - lower) * (rank - below) / in_bucket
        lower, below = le, cumulative
    return lower


@dataclass(frozen=True)
class PodSample:
    """The values of one scrape of one runtime pod (summed over `model_name` label sets)."""

    url: str
    scraped_at: float
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    prompt_tokens_waiting: float = 0.0
    prompt_tokens_total: float | None = None
    rejected_total: float | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None


def _histogram(samples: Sequence[tuple[str, dict[str, str], float]], name: str) -> Histogram | None:
    buckets: dict[float, float] = {}
    count = total = 0.0
    found = False
    for sample_name, labels, value in samples:
        if sample_name == f"{name}_bucket":
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
            found = True
        elif sample_name == f"{name}_count":
            count += value
        elif sample_name == f"{name}_sum":
            total += value
    if not found:
        return None
    return Histogram(tuple(sorted(buckets.items())), count, total)


def parse_pod_metrics(text: str, url: str, scraped_at: float) -> PodSample:
    """Parse one pod's Prometheus text exposition. Raises ValueError on malformed text."""
    samples: list[tuple[str, dict[str, str], float]] = []
    for family in text_string_to_metric_families(text):
        samples.extend((s.name, s.labels, float(s.value)) for s in family.samples)

    def total(name: str) -> float | None:
        values = [v for n, _, v in samples if n == name]
        return sum(values) if values else None

    def first(names: Sequence[str]) -> float | None:
        for name in names:
            value = total(name)
            if value is not None:
                return value
        return None

    def first_hist(names: Sequence[str]) -> Histogram | None:
        for name in names:
            h = _histogram(samples, name)
            if h is not None:
                return h
        return None

    if total(RUNNING) is None and total(WAITING) is None:
        raise ValueError(f"{url}: no {RUNNING} or {WAITING} in the metrics: not a Sovereign runtime?")
    return PodSample(
        url=url,
        scraped_at=scraped_at,
        running=total(RUNNING) or 0.0,
        waiting=total(WAITING) or 0.0,
        kv_usage=first(KV_USAGE),
        prompt_tokens_waiting=total(PROMPT_BACKLOG) or 0.0,
        prompt_tokens_total=total(PROMPT_TOKENS_TOTAL),
        rejected_total=total(REJECTED_TOTAL),
        ttft=_histogram(samples, TTFT),
        itl=first_hist(ITL),
    )


def _latency(q: float | None, hist: Histogram | None) -> float | None:
    if hist is None or hist.count <= 0:
        return None
    if q is None:
        return hist.total / hist.count
    return histogram_quantile(q, hist)


def aggregate_pool(
    current: Mapping[str, PodSample],
    previous: Mapping[str, PodSample],
    *,
    pods_expected: int,
    now: float,
    quantile: float | None = 0.9,
    errors: Sequence[str] = (),
) -> PoolMetrics:
    """One pool's metrics from this round's pod samples and the previous round's, both keyed by
    the sample's `url` (a pod matches its previous sample by URL).

    Queues are summed, KV usage averaged (and maxed), latencies are the quantile (or the mean when
    `quantile` is None) of the observations between the two rounds; pods seen for the first time
    contribute gauges but no latency window until their second round. Requests the pods refused for load (429) between
    the two rounds count as waiting: a full queue hides exactly the demand that should scale up.
    """
    pods = list(current.values())
    if not pods:
        return PoolMetrics(
            observed_at=now, pods_reporting=0, pods_expected=pods_expected, errors=tuple(errors)
        )
    kv = [p.kv_usage for p in pods if p.kv_usage is not None]
    ttft_deltas: list[Histogram] = []
    itl_deltas: list[Histogram] = []
    rate = 0.0
    rejected = 0.0
    for p in pods:
        before = previous.get(p.url)
        if before is None:
            continue
        if p.rejected_total is not None and before.rejected_total is not None:
            # A counter that went down is a restarted pod: all of its count is new.
            grew = p.rejected_total - before.rejected_total
            rejected += grew if grew >= 0 else p.rejected_total
        if p.ttft is not None:
            ttft_deltas.append(p.ttft.minus(before.ttft))
        if p.itl is not None:
            itl_deltas.append(p.itl.minus(before.itl))
        dt = p.scraped_at - before.scraped_at
        if p.prompt_tokens_total is not None and before.prompt_tokens_total is not None and dt > 0:
            rate += max(0.0, p.prompt_tokens_total - before.prompt_tokens_total) / dt
    return PoolMetrics(
        observed_at=min(p.scraped_at for p in pods),
        pods_reporting=len(pods),
        pods_expected=pods_expected,
        requests_running=sum(p.running for p in pods),
        requests_waiting=sum(p.waiting for p in pods) + rejected,
        requests_rejected=rejected,
        prompt_tokens_waiting=sum(p.prompt_tokens_waiting for p in pods),
        kv_cache_usage_mean=sum(kv) / len(kv) if kv else 0.0,
        kv_cache_usage_max=max(kv) if kv else 0.0,
        ttft_seconds=_latency(quantile, merge_histograms(ttft_deltas)),
        itl_seconds=_latency(quantile, merge_histograms(itl_deltas)),
        prompt_tokens_per_s=rate,
        errors=tuple(errors),
    )


class PodScraper:
    """Scrapes the pods of each pool concurrently and remembers the last sample per pod URL, so
    each round's latencies cover the time since the previous round."""

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        quantile: float | None = 0.9,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._quantile = quantile
        self._clock = clock
        self._previous: dict[str, dict[str, PodSample]] = {}

    async def _scrape_one(self, session: aiohttp.ClientSession, url: str) -> PodSample:
        async with session.get(url, timeout=self._timeout) as resp:
            if resp.status != 200:
                raise ValueError(f"{url}: HTTP {resp.status}")
            text = await resp.text()
        return parse_pod_metrics(text, url, self._clock())

    async def scrape_pool(
        self, session: aiohttp.ClientSession, pool_key: str, urls: Sequence[str]
    ) -> PoolMetrics:
        """Scrape every URL (each a pod's full ``/metrics`` URL); failures become `errors`."""
        results = await asyncio.gather(*(self._scrape_one(session, u) for u in urls), return_exceptions=True)
        current: dict[str, PodSample] = {}
        errors: list[str] = []
        for url, res in zip(urls, results, strict=True):
            if isinstance(res, PodSample):
                current[url] = res
            elif isinstance(res, asyncio.TimeoutError | TimeoutError):
                errors.append(f"{url}: timed out")
            else:
                errors.append(f"{url}: {res}" if str(url) not in str(res) else str(res))
        previous = self._previous.get(pool_key, {})
        # Keep the last good sample of pods that failed this round, so their next window is right.
        self._previous[pool_key] = {**{u: s for u, s in previous.items() if u in urls}, **current}
        return aggregate_pool(
            current,
            previous,
            pods_expected=len(urls),
            now=self._clock(),
            quantile=self._quantile,
            errors=errors,
        )

    def forget(self, pool_key: str) -> None:
        self._previous.pop(pool_key, None)


# ---- Prometheus HTTP API --------------------------------------------------------------------------


def prometheus_queries(selector: str, window_s: float, quantile: float | None) -> dict[str, str]:
    """The PromQL for one pool; `selector` is a label matcher body such as
    ``namespace="llm",pod=~"v3-decode-[0-9]+"``."""
    s = "{" + selector + "}"
    w = f"[{max(1, round(window_s))}s]"

    def latency(name: str) -> str:
        if quantile is None:
            return f"sum(rate({name}_sum{s}{w})) / sum(rate({name}_count{s}{w}))"
        return f"histogram_quantile({quantile}, sum by (le) (rate({name}_bucket{s}{w})))"

    return {
        "pods": f"count({RUNNING}{s})",
        # When the oldest pod's gauge was last scraped: the staleness check reads this.
        "sample_time": f"min(timestamp({RUNNING}{s}))",
        "running": f"sum({RUNNING}{s})",
        "waiting": f"sum({WAITING}{s})",
        "prompt_tokens_waiting": f"sum({PROMPT_BACKLOG}{s})",
        "kv_mean": f"avg({KV_USAGE[0]}{s})",
        "kv_max": f"max({KV_USAGE[0]}{s})",
        "ttft": latency(TTFT),
        "itl": latency(ITL[0]),
        "prompt_tokens_per_s": f"sum(rate({PROMPT_TOKENS_TOTAL}{s}{w}))",
        "rejected": f"sum(increase({REJECTED_TOTAL}{s}{w}))",
    }


async def _instant_query(
    session: aiohttp.ClientSession, base_url: str, query: str, timeout: aiohttp.ClientTimeout
) -> tuple[float, float] | None:
    """(timestamp, value) of a scalar-like instant query; None for an empty result or NaN."""
    async with session.get(
        f"{base_url.rstrip('/')}/api/v1/query", params={"query": query}, timeout=timeout
    ) as resp:
        body = await resp.json(content_type=None)
    if resp.status != 200 or body.get("status") != "success":
        raise ValueError(f"prometheus query failed ({resp.status}): {body.get('error', body)}")
    result = body["data"]["result"]
    if body["data"].get("resultType") == "scalar":
        result = [{"value": result}]
    if not result:
        return None
    ts, raw = result[0]["value"]
    value = float(raw)
    if math.isnan(value):
        return None
    return float(ts), value


async def query_prometheus_pool(
    session: aiohttp.ClientSession,
    base_url: str,
    selector: str,
    *,
    pods_expected: int,
    window_s: float,
    quantile: float | None = 0.9,
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.time,
) -> PoolMetrics:
    """One pool's metrics from a Prometheus-compatible HTTP API (``/api/v1/query``)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    queries = prometheus_queries(selector, window_s, quantile)
    try:
        answers = await asyncio.gather(
            *(_instant_query(session, base_url, q, timeout) for q in queries.values())
        )
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return PoolMetrics(
            observed_at=clock(),
            pods_reporting=0,
            pods_expected=pods_expected,
            errors=(f"prometheus {base_url}: {exc or type(exc).__name__}",),
        )
    got = dict(zip(queries, answers, strict=True))
    pods = got["pods"]
    if pods is None:
        return PoolMetrics(
            observed_at=clock(),
            pods_reporting=0,
            pods_expected=pods_expected,
            errors=(f"prometheus {base_url}: no series match {{{selector}}}",),
        )

    def val(key: str, default: float = 0.0) -> float:
        answer = got[key]
        return answer[1] if answer is not None else default

    return PoolMetrics(
        # Instant results carry the query time; the samples' own scrape time tells staleness.
        observed_at=val("sample_time", pods[0]),
        pods_reporting=round(pods[1]),
        pods_expected=pods_expected,
        requests_running=val("running"),
        requests_waiting=val("waiting") + val("rejected"),
        requests_rejected=val("rejected"),
        prompt_tokens_waiting=val("prompt_tokens_waiting"),
        kv_cache_usage_mean=val("kv_mean"),
        kv_cache_usage_max=val("kv_max"),
        ttft_seconds=got["ttft"][1] if got["ttft"] else None,
        itl_seconds=got["itl"][1] if got["itl"] else None,
        prompt_tokens_per_s=val("prompt_tokens_per_s"),
    )
