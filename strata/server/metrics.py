"""Prometheus metrics of one server, in a registry of its own: vLLM's metric names with a `strata:` prefix, and
always also the families external schedulers read (Gateway API Inference Extension, llm-d, dashboards) under
vLLM's own `vllm:` names, with vLLM's meanings, units and histogram buckets."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from strata.outputs import RequestOutput

# vLLM's buckets (v1 loggers), so that dashboards and SLO queries written for vLLM read the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
# The families exported a second time under vLLM's names (the rest are strata's own).
_VLLM_FAMILIES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "request_success", "prompt_tokens", "generation_tokens",
    "time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "mm_cache_queries",
    "mm_cache_hits"})


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
        images = getattr(getattr(self.engine, "input", None), "image_cache", None)
        if images is not None:  # multimodal models with --mm-processor-cache-gb > 0
            yield counter("mm_cache_queries", "Images looked up in the decoded-image cache.", images.queries)
            yield counter("mm_cache_hits", "Images found in the decoded-image cache.", images.hits)
            yield gauge("mm_cache_bytes", "Bytes of decoded images cached.", images.num_bytes)
            yield gauge("mm_cache_items", "Decoded images cached.", len(images))
        cache = self.engine.config.cache
        info = InfoMetricFamily("strata:cache_config", "KV cache configuration.")
        info.add_metric([], {"block_size": str(cache.block_size), "num_gpu_blocks": str(stats["total_blocks"]),
                             "enable_prefix_caching": str(cache.enable_prefix_caching)})
        yield info
        if stats.get("spec_decode") is not None:
            yield from _spec_decode_metrics(stats["spec_decode"], labels, values)


def _spec_decode_metrics(spec: Any, labels: list[str], values: list[str]) -> Iterator[Metric]:
    """Speculative decoding's counters (vLLM's): verification steps with drafts, draft tokens, accepted draft
    tokens, and accepted ones by position in the draft."""
    for name, doc, value in (
            ("spec_decode_num_drafts", "Verification steps that carried draft tokens.", spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
        metric = CounterMetricFamily(f"strata:{name}", doc, labels=labels)
        metric.add_metric(values, value)
        yield metric
    per_pos = CounterMetricFamily("strata:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft (0 = first).",
                                  labels=[*labels, "position"])
    for position, count in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([*values, str(position)], count)
    yield per_pos


class _VllmNames(Collector):
    """The `_VLLM_FAMILIES` of a registry again, renamed `strata:` -> `vllm:` (same values, read at scrape)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name.removeprefix("strata:") not in _VLLM_FAMILIES:
                continue
            renamed = Metric("vllm:" + family.name.removeprefix("strata:"), family.documentation, family.type,
                             family.unit)
            renamed.samples = [s._replace(name="vllm:" + s.name.removeprefix("strata:")) for s in family.samples]
            yield renamed


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
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("strata:inter_token_latency_seconds", "Time between a request's engine outputs.",
                             name, buckets=_TOKEN_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("strata:time_per_output_token_seconds", "Time per output token after the first.",
                              name, buckets=_TOKEN_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("strata:e2e_request_latency_seconds", "Arrival to last output.", name,
                             buckets=_REQUEST_LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram("strata:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    name, buckets=_REQUEST_LATENCY_BUCKETS, registry=reg)
        self.request_prompt_tokens = Histogram("strata:request_prompt_tokens", "Prompt tokens per request.", name,
                                               buckets=_TOKEN_BUCKETS, registry=reg)
        self.request_generation_tokens = Histogram("strata:request_generation_tokens",
                                                   "Generated tokens per request.", name,
                                                   buckets=_TOKEN_BUCKETS, registry=reg)
        self.registry.register(_EngineCollector(engine, model_name))
        self.vllm_registry = CollectorRegistry()
        self.vllm_registry.register(_VllmNames(self.registry))

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)

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
                        per_token = (now - last_time) / (total - num_tokens)
                        for _ in range(total - num_tokens):
                            self.tpot.labels(self.model_name).observe(per_token)
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
        if "queue_time" in final.metrics:
            self.queue_time.labels(name).observe(final.metrics["queue_time"])
        self.e2e.labels(name).observe(time.monotonic() - arrival)
