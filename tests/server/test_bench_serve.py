"""`strata bench serve` against the test server: the vLLM-style report and its JSON."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from conftest import API_KEY, MODEL, REPO, child_env

from strata.bench.serve import RequestResult, format_report, summarize


def test_bench_serve_reports_like_vllm_and_writes_json(server, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "strata", "bench", "serve", "--base-url", server.url, "--model", MODEL,
           "--num-prompts", "12", "--request-rate", "inf", "--input-len", "12", "--output-len", "6",
           "--tokenizer", str(server.checkpoint), "--api-key", API_KEY, "--ignore-eos", "--output-json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stdout
    assert "============ Serving Benchmark Result ============" in report
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Total token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                  "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "Median ITL (ms):",
                  "P99 ITL (ms):"):
        assert label in report
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_input_tokens"] == 12 * 12 and result["total_output_tokens"] == 12 * 6
    assert result["mean_ttft_ms"] > 0 and result["p99_itl_ms"] >= result["median_itl_ms"] > 0


def test_bench_serve_with_word_prompts_rate_and_concurrency_limit(server, tmp_path):
    from strata.bench.serve import run_bench_serve

    args = argparse.Namespace(base_url=server.url, model=MODEL, endpoint="/v1/chat/completions", num_prompts=6,
                              request_rate=50.0, input_len=5, output_len=4, max_concurrency=2, tokenizer=None,
                              seed=0, api_key=API_KEY, ignore_eos=True, output_json=str(tmp_path / "r.json"))
    assert run_bench_serve(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 6 and result["max_concurrent_requests"] <= 2
    assert result["total_output_tokens"] == 24 and result["total_input_tokens"] > 0


def test_failed_requests_are_counted_not_fatal():
    args = argparse.Namespace(base_url="http://x", endpoint="/v1/completions", model="m", request_rate=float("inf"),
                              max_concurrency=None)
    ok = RequestResult(success=True, prompt_len=4, output_tokens=3, ttft=0.1, latency=0.3, itl=[0.1, 0.1])
    summary = summarize(args, [ok, RequestResult(error="HTTP 500")], duration=1.0, peak=2)
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (1, 1, 3)
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)
    assert "Failed requests:                         1" in format_report(summary)
