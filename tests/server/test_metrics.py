"""/metrics (Prometheus): vLLM's metric names with a `strata:` prefix, and counts that add up."""
from __future__ import annotations

import httpx
from conftest import MODEL, read_metrics

PROMPT = [70, 71, 72, 73, 74, 75]


def test_metrics_count_requests_tokens_and_latencies(server, http):
    before = read_metrics(server.url)
    for i in range(5):
        body = {"model": MODEL, "prompt": [80 + i, *PROMPT], "max_tokens": 10, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200
    after = read_metrics(server.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    p = len(PROMPT) + 1
    assert delta('strata:request_success_total{finished_reason="length"}') == 5
    assert delta("strata:prompt_tokens_total") == 5 * p
    assert delta("strata:generation_tokens_total") == 50
    assert delta("strata:time_to_first_token_seconds_count") == 5
    assert delta("strata:inter_token_latency_seconds_count") == 5 * 9
    assert delta("strata:time_per_output_token_seconds_count") == 5 * 9
    assert delta("strata:request_queue_time_seconds_count") == 5
    assert delta("strata:e2e_request_latency_seconds_count") == 5
    assert delta("strata:request_prompt_tokens_sum") == 5 * p
    assert delta("strata:request_generation_tokens_sum") == 50
    assert delta("strata:prefix_cache_queries_total") >= 5 * p


def test_metrics_expose_the_gauges_and_histogram_families(server):
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("strata:num_requests_running", "strata:num_requests_waiting", "strata:kv_cache_usage_perc",
                 "strata:prefix_cache_queries_total", "strata:prefix_cache_hits_total",
                 "strata:num_preemptions_total", f'model_name="{MODEL}"'):
        assert name in text
    for family in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "request_prompt_tokens", "request_generation_tokens"):
        for suffix in ("_sum", "_bucket", "_count"):
            assert f"strata:{family}{suffix}" in text


def test_vllm_names_carry_the_same_values_for_external_schedulers(server, http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    m = read_metrics(server.url)
    for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_hits_total", "prompt_tokens_total", "time_to_first_token_seconds_count",
                   "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                   "request_queue_time_seconds_count", 'request_success_total{finished_reason="length"}'):
        assert m[f"vllm:{family}"] == m[f"strata:{family}"], family
    assert 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0
    info = [k for k in m if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0]
    text = httpx.get(f"{server.url}/metrics").text
    # vLLM's TTFT buckets (their first one is 1 ms, the last 2560 s) and its request-latency ones.
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.001"' in text
    assert 'vllm:time_to_first_token_seconds_bucket{le="2560.0"' in text
    assert 'vllm:e2e_request_latency_seconds_bucket{le="7680.0"' in text
