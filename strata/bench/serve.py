"""`strata bench serve`: streamed random requests against any OpenAI-compatible server, reported like
`vllm bench serve` (throughputs and mean/median/P99 of TTFT, TPOT and ITL)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# Plain English words, so that word prompts need no tokenizer and make sense to any model.
_WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or had not "
          "first one their its new after who they have has her she two been other when there all during into "
          "school time may years more most only over city some world would where later up such used many can "
          "state about national out known university united then made team american under").split()
_REQUEST_TIMEOUT_S = 600.0


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(args: argparse.Namespace) -> list[tuple[str | list[int], int]]:
    """(prompt, its length in tokens, 0 when unknown): token ids with --tokenizer, else random words. With
    --prefix-len, each prompt starts with one of --num-prefixes shared prefixes (in random order), as many
    users of a few system prompts do."""
    rng = random.Random(args.seed)
    prefix_len, num_prefixes = getattr(args, "prefix_len", 0), getattr(args, "num_prefixes", 1)
    if args.tokenizer:
        from strata.model_source import resolve_tokenizer
        from strata.tokenizer import load_tokenizer

        if args.tokenizer.endswith(".gguf") and Path(args.tokenizer).is_file():  # the one a GGUF file describes
            folder = str(Path(args.tokenizer).parent)
            tokenizer = load_tokenizer(folder, gguf_file=args.tokenizer)
        else:
            folder = resolve_tokenizer(args.tokenizer)  # a folder, or a Hub ID: its tokenizer files downloaded
            tokenizer = load_tokenizer(folder)
        special = set(tokenizer.all_special_ids)
        vocab = [t for t in range(_vocab_size(folder, tokenizer)) if t not in special]
        prefixes = [[rng.choice(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
        prompts = [prefixes[i % num_prefixes] + [rng.choice(vocab) for _ in range(args.input_len)]
                   for i in range(args.num_prompts)]
        rng.shuffle(prompts)
        if "chat" in args.endpoint:  # chat takes text: send what the ids decode to
            return [(tokenizer.decode(p), 0) for p in prompts]
        return [(p, len(p)) for p in prompts]
    prefixes = [" ".join(rng.choice(_WORDS) for _ in range(prefix_len)) for _ in range(num_prefixes)]
    texts = [(prefixes[i % num_prefixes] + " " + " ".join(rng.choice(_WORDS) for _ in range(args.input_len))).strip()
             for i in range(args.num_prompts)]
    rng.shuffle(texts)
    return [(t, 0) for t in texts]


def _vocab_size(folder: str, tokenizer: Any) -> int:
    """Ids every part accepts: a checkpoint's tokenizer may know more ids than its model's embedding."""
    size = len(tokenizer)
    config = Path(folder) / "config.json"
    if config.is_file():
        values = json.loads(config.read_text())
        size = min(size, (values.get("text_config") or values).get("vocab_size", size))
    return size


def _body(args: argparse.Namespace, prompt: str | list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "max_tokens": args.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if "chat" in args.endpoint:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_request(client: Any, url: str, body: dict[str, Any], prompt_len: int) -> RequestResult:
    """One streamed request; TTFT is the first chunk with text, ITL the gaps between later ones."""
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    result.prompt_len = chunk["usage"].get("prompt_tokens", prompt_len)
        result.latency = time.perf_counter() - start
        result.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(args: argparse.Namespace, prompts: list[tuple[str | list[int], int]]
                        ) -> tuple[list[RequestResult], float, int]:
    """Send every prompt (Poisson arrivals at --request-rate); returns results, duration, peak concurrency."""
    import httpx

    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)
    rng = random.Random(args.seed)
    active, peak = 0, 0

    async def one(client: httpx.AsyncClient, prompt: str | list[int], prompt_len: int) -> RequestResult:
        nonlocal active, peak
        async with semaphore:
            active += 1
            peak = max(peak, active)
            try:
                return await send_request(client, url, _body(args, prompt), prompt_len)
            finally:
                active -= 1

    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(headers=headers, timeout=_REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, prompt_len in prompts:
            tasks.append(asyncio.create_task(one(client, prompt, prompt_len)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration, peak


def summarize(args: argparse.Namespace, results: list[RequestResult], duration: float, peak: int
              ) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "backend": "openai-chat" if "chat" in args.endpoint else "openai", "base_url": args.base_url,
        "endpoint": args.endpoint, "model": args.model, "num_prompts": len(results),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "duration": duration, "completed": len(ok),
        "failed": len(results) - len(ok), "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration, "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration, "max_concurrent_requests": peak}
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots), ("itl", [x for r in ok for x in r.itl]),
                         ("e2el", [r.latency for r in ok])):
        ms = np.asarray(values, dtype=float) * 1000 if values else np.zeros(1)
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        summary[f"std_{name}_ms"] = float(ms.std())
        summary[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    summary.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                   ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                   errors=[r.error for r in results])
    return summary


def format_report(s: dict[str, Any]) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        fmt = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
        lines.append(fmt.format(label, value if isinstance(value, int | float) else str(value)))

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Maximum request concurrency:", s["max_concurrency"])
    row("Request rate configured (RPS):", s["request_rate"])
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Peak concurrent requests:", s["max_concurrent_requests"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, title, short in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", s[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", s[f"median_{key}_ms"])
        row(f"P99 {short} (ms):", s[f"p99_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines) + "\n"


def run_bench_serve(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report
    prompts = make_prompts(args)
    logger.info("sending %d requests to %s%s at %s req/s (max concurrency %s)", len(prompts), args.base_url,
                args.endpoint, args.request_rate, args.max_concurrency)
    results, duration, peak = asyncio.run(run_benchmark(args, prompts))
    for error in sorted({r.error for r in results if r.error})[:5]:
        logger.warning("failed request: %s", error)
    summary = summarize(args, results, duration, peak)
    sys.stdout.write(format_report(summary))  # the command's report, for the terminal
    sys.stdout.flush()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["completed"] else 1

