"""Prometheus metrics of one server (vLLM's names with a `strata:` prefix), in a registry of its own."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from strata.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _EngineCollector(Collector):
    """Scheduler state read at scrape time, so the gauges can never go stale."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(f"strata:{name}", doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(f"strata:{name}", doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        yield gauge("num_requests_running", "Requests being computed (one per sample).", stats["running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats["waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", stats["kv_usage"])
        yield gauge("kv_cache_free_blocks", "KV cache blocks free (cached prefixes count as free).",
                    stats["free_blocks"])
        yield gauge("kv_cache_total_blocks", "KV cache blocks in the pool.", stats["total_blocks"])
        yield gauge("engine_dead", "1 once the engine has failed.", float(bool(self.engine.is_dead)))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.get("prefix_queries", 0))
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.get("prefix_hits", 0))
        yield counter("num_preemptions", "Requests preempted (to be recomputed).", stats.get("num_preemptions", 0))


class ServerMetrics:
    """Request-level counters and histograms, fed by `track` around every engine stream."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, name = self.registry, ["model_name"]
        self.request_success = Counter("strata:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.prompt_tokens = Counter("strata:prompt_tokens", "Prompt tokens of started requests.", name,
                                     registry=reg)
        self.generation_tokens = Counter("strata:generation_tokens", "Generated tokens.", name, registry=reg)
        self.ttft = Histogram("strata:time_to_first_token_seconds", "Time to the first generated token.", name,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("strata:inter_token_latency_seconds", "Time between a request's engine outputs.",
                             name, buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("strata:e2e_request_latency_seconds", "Arrival to last output.", name,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.request_prompt_tokens = Histogram("strata:request_prompt_tokens", "Prompt tokens per request.", name,
                                               buckets=_TOKEN_BUCKETS, registry=reg)
        self.request_generation_tokens = Histogram("strata:request_generation_tokens",
                                                   "Generated tokens per request.", name,
                                                   buckets=_TOKEN_BUCKETS, registry=reg)
        self.registry.register(_EngineCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def track(self, stream: AsyncIterator[RequestOutput], arrival: float) -> AsyncIterator[RequestOutput]:
        """Pass outputs through while timing them; counts the request however it ends."""
        last_time, num_tokens, final = None, 0, None
        reason = "abort"
        try:
            async for out in stream:
                now = time.monotonic()
                total = sum(len(o.token_ids) for o in out.outputs)
                if total > num_tokens:
                    if last_time is None:
                        self.ttft.labels(self.model_name).observe(now - arrival)
                        self.prompt_tokens.labels(self.model_name).inc(len(out.prompt_token_ids))
                    else:
                        self.itl.labels(self.model_name).observe(now - last_time)
                    self.generation_tokens.labels(self.model_name).inc(total - num_tokens)
                    last_time, num_tokens = now, total
                final = out
                yield out
        except Exception:
            reason = "error"
            raise
        finally:
            self._finish(final, arrival, reason)

    def _finish(self, final: RequestOutput | None, arrival: float, default_reason: str) -> None:
        name = self.model_name
        if final is None:
            self.request_success.labels(name, default_reason).inc()
            return
        for seq in final.outputs:
            self.request_success.labels(name, seq.finish_reason or default_reason).inc()
            self.request_generation_tokens.labels(name).observe(len(seq.token_ids))
        self.request_prompt_tokens.labels(name).observe(len(final.prompt_token_ids))
        self.e2e.labels(name).observe(time.monotonic() - arrival)
