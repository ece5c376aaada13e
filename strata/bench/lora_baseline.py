"""LoRA serving speed beside llama-server's `--lora` on the same base (`python -m strata.bench.lora_baseline WORKDIR`):
a random Llama-250M and random PEFT adapters (their GGUF files for llama.cpp), each server's output tokens/s with
requests spread over the adapters against its base requests, at 16 concurrent requests and at batch 1."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.bench.lora import random_adapter
from strata.bench.machine import cpu_model
from strata.bench.serve import send_request, summarize

logger = logging.getLogger(__name__)

# Where ../shared/tools/llama_cpp_anchor.sh builds llama.cpp (its $ANCHOR_DIR).
LLAMA_CPP = Path(os.environ.get("ANCHOR_DIR", Path.home() / ".cache/strata-anchors")) / \
    "llama_cpp_python-0.3.36/vendor/llama.cpp"
# convert_hf_to_gguf.py, told to treat the bench tokenizer as GPT-2 style BPE (the anchor script's way: llama.cpp
# does not know its pre-tokenizer hash, and speed does not depend on it).
_CONVERT_BASE = """import sys
src, model, out, outtype = sys.argv[1:5]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
import convert_hf_to_gguf as convert
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
convert.main()
"""


@dataclass(frozen=True)
class Files:
    base: Path
    adapters: list[Path]
    base_gguf: Path
    adapter_ggufs: list[Path]


def prepare(workdir: Path, rank: int, num_loras: int, outtype: str) -> Files:
    """The base checkpoint, the adapters and their GGUF conversions under `workdir` (each written once)."""
    from strata.bench.random_model import build

    base = workdir / "llama-250m"
    if not (base / "config.json").is_file():
        build("llama-250m", base)
    adapters = [workdir / f"lora-r{rank}-{i}" for i in range(num_loras)]
    for i, folder in enumerate(adapters):
        if not (folder / "adapter_config.json").is_file():
            random_adapter(str(base), folder, rank, seed=i)
    env = {**os.environ, "PYTHONPATH": f"{LLAMA_CPP}:{LLAMA_CPP}/gguf-py"}
    base_gguf = workdir / f"llama-250m-{outtype}.gguf"
    if not base_gguf.is_file():
        subprocess.run([sys.executable, "-c", _CONVERT_BASE, str(LLAMA_CPP), str(base), str(base_gguf), outtype],
                       check=True, env=env)
    ggufs = [workdir / f"{folder.name}-{outtype}.gguf" for folder in adapters]
    for folder, gguf in zip(adapters, ggufs, strict=True):
        if not gguf.is_file():
            subprocess.run([sys.executable, str(LLAMA_CPP / "convert_lora_to_gguf.py"), "--base", str(base),
                            "--outfile", str(gguf), "--outtype", outtype, str(folder)], check=True, env=env)
    return Files(base, adapters, base_gguf, ggufs)


def llama_server_command(files: Files, args: argparse.Namespace) -> list[str]:
    """llama-server with every adapter loaded (each request sets their scales with its "lora" field)."""
    context = args.concurrency * (args.input_len + args.output_len + 64)
    command = [str(LLAMA_CPP / "build/bin/llama-server"), "-m", str(files.base_gguf), "-t", str(args.threads),
               "-np", str(args.concurrency), "-c", str(context), "--port", str(args.port),
               "--lora-init-without-apply"]
    # One --lora with the files comma-separated: given several times, only the last one counts.
    command += ["--lora", ",".join(str(gguf) for gguf in files.adapter_ggufs)]
    return command + args.llama_args.split()


def strata_server_command(files: Files, args: argparse.Namespace) -> list[str]:
    modules = [f"lora{i}={folder}" for i, folder in enumerate(files.adapters)]
    return [sys.executable, "-m", "strata", "serve", str(files.base), "--port", str(args.port),
            "--served-model-name", "base", "--dtype", args.dtype, "--device", "cpu", "--disable-log-requests",
            "--max-num-seqs", str(args.concurrency), "--enable-lora", "--max-loras", str(len(files.adapters)),
            "--max-lora-rank", str(args.rank), "--lora-modules", *modules]


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not ready within {timeout_s:.0f} s")


def _body(server: str, prompt: list[int], args: argparse.Namespace, adapter: int | None) -> dict[str, Any]:
    """A streamed greedy completion of `prompt`; `adapter` picks one (llama-server: its "lora" field with that
    adapter at scale 1, the others at 0, all at 0 for the base: a request without the field gets every adapter at
    the server's scale, 1; strata: its served name). llama-server's prompt cache is off: it would reuse a prompt's
    KV computed under another adapter."""
    body: dict[str, Any] = {"model": "base", "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if server == "llama-server":
        body.update(n_predict=args.output_len, cache_prompt=False,
                    lora=[{"id": i, "scale": float(i == adapter)} for i in range(args.num_loras)])
    elif adapter is not None:
        body["model"] = f"lora{adapter}"
    return body


async def _run(url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    import httpx

    semaphore = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, body: dict[str, Any]):
        async with semaphore:
            return await send_request(client, url + "/v1/completions", body, len(body["prompt"]))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, b) for b in bodies))
        duration = time.perf_counter() - start
    failed = [r.error for r in results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, the first: {failed[0]}")
    ns = argparse.Namespace(endpoint="/v1/completions", base_url=url, model="", request_rate=float("inf"),
                            max_concurrency=concurrency)
    return summarize(ns, list(results), duration, concurrency)


def measure(server: str, url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Best of --rounds of each case, base and adapter runs alternating: output tokens/s and mean TPOT (ms). Each
    run has prompts of its own, so that no run reuses another's cached prompt."""
    rng = random.Random(args.seed)
    cases = {"base x16": (args.concurrency, None), "loras x16": (args.concurrency, "spread"),
             "base x1": (1, None), "lora x1": (1, 0)}
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for case, (concurrency, adapter) in cases.items():
            count = args.num_prompts if concurrency > 1 else args.batch1_prompts
            chosen = [[rng.randrange(100, 31000) for _ in range(args.input_len)] for _ in range(count)]
            bodies = [_body(server, p, args, i % args.num_loras if adapter == "spread" else adapter)
                      for i, p in enumerate(chosen)]
            s = _run_sync(url, bodies, concurrency)
            logger.info("%s %s: %.1f output tok/s, mean TPOT %.1f ms", server, case, s["output_throughput"],
                        s["mean_tpot_ms"])
            if s["total_output_tokens"] != len(bodies) * args.output_len:
                raise SystemExit(f"{server} {case}: {s['total_output_tokens']} output tokens, expected "
                                 f"{len(bodies) * args.output_len} (usage missing from the stream?)")
            if case not in best or s["output_throughput"] > best[case]["tok_s"]:
                best[case] = {"tok_s": s["output_throughput"], "tpot_ms": s["mean_tpot_ms"]}
    return best


def _run_sync(url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    return asyncio.run(_run(url, bodies, concurrency))


def report(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> str:
    lines = [f"CPU: {platform.processor() or platform.machine()} ({cpu_model()}), {args.threads} threads; "
             f"{args.num_loras} adapters of rank {args.rank}; {args.input_len} in / {args.output_len} out; best of "
             f"{args.rounds} alternating rounds",
             "| server | base x16 tok/s | 4 adapters x16 tok/s (ratio) | base x1 tok/s | 1 adapter x1 tok/s (ratio) |",
             "|---|---|---|---|---|"]
    for server, best in results.items():
        b16, l16, b1, l1 = (best[c]["tok_s"] for c in ("base x16", "loras x16", "base x1", "lora x1"))
        lines.append(f"| {server} | {b16:.1f} | {l16:.1f} ({l16 / b16:.2f}x) | {b1:.1f} | {l1:.1f} "
                     f"({l1 / b1:.2f}x) |")
    return "\n".join(lines) + "\n"


def run_server(server: str, files: Files, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    command = llama_server_command(files, args) if server == "llama-server" else strata_server_command(files, args)
    # Both on --threads (strata's through OpenMP's and torch's thread count).
    env = {**os.environ, "LD_LIBRARY_PATH": f"{LLAMA_CPP}/build/bin:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "OMP_NUM_THREADS": str(args.threads)}
    logger.info("starting %s", " ".join(command))
    log = open(args.workdir / f"{server}.log", "w")  # noqa: SIM115 (open while the server runs)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{args.port}"
        _wait_ready(url, process)
        return measure(server, url, args)
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workdir", type=Path, help="where the checkpoint, adapters and GGUF files are (re)used")
    parser.add_argument("--servers", nargs="+", default=["llama-server", "strata"], choices=["llama-server", "strata"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-loras", type=int, default=4)
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16"], help="GGUF weights")
    parser.add_argument("--dtype", default="float32", help="strata's weights")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch1-prompts", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '--poll 0' on a shared "
                                                          "machine (its threads spin-wait otherwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.workdir.mkdir(parents=True, exist_ok=True)
    files = prepare(args.workdir, args.rank, args.num_loras, args.outtype)
    results = {server: run_server(server, files, args) for server in args.servers}
    sys.stdout.write(report(results, args))
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
