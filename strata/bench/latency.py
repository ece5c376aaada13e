"""`strata bench latency`: time per output token of one batch after a fixed prompt (vLLM's name), with the
effective weight bandwidth (the bytes of weights a decode step reads over the time it takes), the prefill's rate,
and for scale the machine's plain read loop and best torch matmul. Each timed figure is printed twice, labelled:
the best of the --num-iters runs (what the machine can do) and their mean (what a run costs on average)."""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from strata.bench.image_latency import add_image_latency_args, run_image_latency
from strata.bench.lora import add_lora_bench_args, bench_lora_requests, decode_path_line
from strata.bench.machine import machine_line
from strata.bench.throughput import random_prompts
from strata.config.engine_args import EngineArgs, engine_kwargs
from strata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `strata bench latency`: the batch and its lengths, then every engine option."""
    parser.add_argument("--model", required=True, help="checkpoint folder, .gguf file or Hub ID")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of each sequence")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of each sequence (at least 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--num-iters", type=int, default=3,
                        help="timed runs; the best of them and their mean are both printed")
    parser.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    add_image_latency_args(parser)
    add_lora_bench_args(parser)
    EngineArgs.add_cli_args(parser)


def weight_bytes(args: argparse.Namespace) -> int:
    """Parameter bytes over all ranks, as `strata plan` counts them (quantized weights at their packed size),
    less an untied embedding table, of which a decode step reads one row per token (a tied one is the LM
    head, read whole)."""
    from strata.config import EngineConfig
    from strata.plan import plan_layout

    config = EngineConfig.from_args(EngineArgs.from_cli_args(args, args.model))
    return sum(p.param_bytes - p.lookup_table_bytes for p in plan_layout(config))


def read_loop_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second a plain read of `nbytes` (a float32 sum, every thread) reaches here: the memory speed
    a weight-bound decode step can approach."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def torch_matmul_gflops(size: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s of torch's best float32 matmul here (square, every thread): the compute scale a prefill can approach."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size ** 3 / best / 1e9


def prefill_seconds(llm, prompt_sets: list[list[list[int]]], loras: list | None = None) -> list[float]:
    """The times to the first token of prompt sets never seen before (the prefix cache holds none)."""
    return [_timed(llm, prompts, 1, loras) for prompts in prompt_sets]


def _timed(llm, prompts: list[list[int]], max_tokens: int, loras: list | None = None) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - started
    if any(len(o.outputs[0].token_ids) != max_tokens for o in outs):
        raise RuntimeError(f"expected {max_tokens} output tokens per prompt")
    return elapsed


@dataclass(frozen=True)
class Timings:
    """The runs of one batch: full runs and runs of one output token (prefill and first token), in seconds."""

    latencies: list[float]
    first_token: list[float]
    output_len: int

    @property
    def best_per_token(self) -> float:
        """Best of N: the fastest full run less the fastest first token, over the remaining tokens."""
        return (min(self.latencies) - min(self.first_token)) / max(1, self.output_len - 1)

    @property
    def mean_per_token(self) -> float:
        """Mean: the mean full run less the mean first token, over the remaining tokens."""
        return (statistics.mean(self.latencies) - statistics.mean(self.first_token)) / max(1, self.output_len - 1)


def measure(llm, prompts: list[list[int]], output_len: int, warmup: int, iters: int, loras: list | None = None
            ) -> Timings:
    """`iters` full runs after `warmup` untimed ones, and `iters` runs of one output token (each prompt with its
    LoRA adapter of `loras`)."""
    for _ in range(warmup):
        _timed(llm, prompts, output_len, loras)
    latencies = [_timed(llm, prompts, output_len, loras) for _ in range(iters)]
    return Timings(latencies, [_timed(llm, prompts, 1, loras) for _ in range(iters)], output_len)


def _on_cuda(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def cpu_kernels_line(llm) -> str:
    """Which CPU paths the run took: the decode steps each fused path served (an in-process model only) and the
    instruction set the small-batch kernels were built for."""
    from strata.bench.activations import gguf_activations
    from strata.kernels.cpu import crossovers
    from strata.kernels.cpu import matmul as cpu_matmul

    runner = getattr(llm.engine.executor, "runner", None)
    model, backend = getattr(runner, "model", None), getattr(runner, "cpu_decode", None)
    if backend is None:
        paths = "decode path not known here (workers in other processes, or a model without the fused path)"
    else:
        served = backend.served
        paths = (f"{served['whole step']} decode steps in one C call each, {served['stack']} with every layer in "
                 f"one call, {served['blocks']} layer by layer in C blocks, of {llm.engine.stats['steps']} steps")
    line = (f"CPU kernels: {paths}; {gguf_activations(llm)}; small-batch products built for "
            f"{cpu_matmul.instruction_set()}")
    choice = crossovers.summary(_weight_kinds(model)) if model is not None else ""
    return f"{line}; {choice}" if choice else line


def _weight_kinds(model) -> dict[int, set[int]]:
    """The kernel kinds of the narrow weights an in-process model's layers hold (GGUF blocks, packed int4 / int8 /
    FP8), each with the rows up to which its layers take the small-batch kernel."""
    from strata.layers.quantization import gguf_quants

    kinds: dict[int, set[int]] = {}
    for module in model.modules():
        quant = getattr(module, "quant", None)
        for w in getattr(quant, "weights", None) or []:  # GGUF: its blocks by type
            kinds.setdefault(gguf_quants.kernel_kind(w.ggml_type), set()).add(quant.small_rows[w.ggml_type])
        weight = getattr(quant, "weight", None) or next(iter(getattr(quant, "gate_up", None) or []), None)
        if hasattr(weight, "kernel_kind"):  # packed int4 / int8 / FP8, a linear's or routed experts'
            rows = quant.small_rows
            kinds.setdefault(weight.kernel_kind, set()).update(rows if isinstance(rows, tuple) else (rows,))
    return kinds


def run_latency(args: argparse.Namespace) -> int:
    from strata.config import ModelConfig, resolve_source
    from strata.llm import LLM

    if args.output_len < 2:
        raise SystemExit("--output-len must be at least 2 to time decode steps")
    if args.num_iters < 1:
        raise SystemExit("--num-iters must be at least 1")
    if args.hf_encoder and not args.image:
        raise SystemExit("--hf-encoder times the vision encoder of an --image run: give --image")
    if args.image:
        result = run_image_latency(args)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    model = ModelConfig.from_path(resolve_source(EngineArgs.from_cli_args(args, args.model)))
    prompts = random_prompts(args.batch_size, args.input_len, model.vocab_size, args.seed, avoid=model.eos_token_ids)
    nbytes = weight_bytes(args)
    read_loop = None if _on_cuda(args.device) else read_loop_bandwidth()
    loras = bench_lora_requests(args, len(prompts))
    llm = LLM(args.model, **engine_kwargs(args))
    try:
        timings = measure(llm, prompts, args.output_len, args.num_iters_warmup, args.num_iters, loras)
        fresh = [random_prompts(args.batch_size, args.input_len, model.vocab_size, args.seed + 1 + i,
                                avoid=model.eos_token_ids) for i in range(args.num_iters)]
        ttfts = prefill_seconds(llm, fresh, loras)
        sys.stdout.write(machine_line(args.device) + "\n")
        sys.stdout.write(decode_path_line(llm, loras))
        if llm.engine.spec is not None:  # --speculative-config: how the drafts fared
            sys.stdout.write(llm.engine.spec.stats.summary() + "\n")
        if read_loop is not None:
            sys.stdout.write(cpu_kernels_line(llm) + "\n")
    finally:
        llm.shutdown()
    result = latency_figures(args, timings, ttfts, nbytes, read_loop)
    sys.stdout.write(report(args, result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def latency_figures(args: argparse.Namespace, timings: Timings, ttfts: list[float], nbytes: int,
                    read_loop: float | None) -> dict:
    """Every figure, for the report and --output-json. The keys vLLM's and earlier strata's JSON had keep their
    meaning (avg_latency: the mean; time_per_output_token and what derives from it: best of N); `*_mean` are
    the means, `best_of` is N."""
    prompt_tokens = args.batch_size * args.input_len
    best, mean = timings.best_per_token, timings.mean_per_token
    ttft, ttft_mean = min(ttfts), statistics.mean(ttfts)
    return {"avg_latency": statistics.mean(timings.latencies), "best_latency": min(timings.latencies),
            "latencies": timings.latencies, "first_token_latencies": timings.first_token,
            "best_of": len(timings.latencies), "batch_size": args.batch_size,
            "input_len": args.input_len, "output_len": args.output_len,
            "time_per_output_token": best, "time_per_output_token_mean": mean,
            "output_tokens_per_second": args.batch_size / best,
            "output_tokens_per_second_mean": args.batch_size / mean,
            "weight_bytes": nbytes, "weight_bandwidth_gb_per_s": nbytes / best / 1e9,
            "weight_bandwidth_gb_per_s_mean": nbytes / mean / 1e9,
            "read_loop_gb_per_s": None if read_loop is None else read_loop / 1e9,
            "time_to_first_token": ttft, "time_to_first_token_mean": ttft_mean, "prefill_latencies": ttfts,
            "prefill_tokens_per_second": prompt_tokens / ttft,
            "prefill_tokens_per_second_mean": prompt_tokens / ttft_mean,
            "torch_matmul_gflops": None if read_loop is None else torch_matmul_gflops()}


def report(args: argparse.Namespace, r: dict) -> str:
    """The printed figures: each timed one as best of N, then the mean of the same N runs."""
    best = f"best of {r['best_of']}"
    lines = [
        f"Avg latency: {r['avg_latency']:.4f} seconds (mean of {r['best_of']} runs; {best}: {r['best_latency']:.4f} s; "
        f"batch {args.batch_size}, {args.input_len} in, {args.output_len} out)",
        f"Time per output token, {best}: {r['time_per_output_token'] * 1e3:.2f} ms, "
        f"{r['output_tokens_per_second']:.2f} output tokens/s; mean: {r['time_per_output_token_mean'] * 1e3:.2f} ms, "
        f"{r['output_tokens_per_second_mean']:.2f} output tokens/s",
        f"Effective weight bandwidth, {best}: {r['weight_bandwidth_gb_per_s']:.2f} GB/s; mean: "
        f"{r['weight_bandwidth_gb_per_s_mean']:.2f} GB/s ({r['weight_bytes'] / 1e9:.3f} GB of weights read per step)",
        f"Prefill, {best}: {r['time_to_first_token'] * 1e3:.1f} ms to the first token, "
        f"{r['prefill_tokens_per_second']:.1f} prompt tokens/s; mean: {r['time_to_first_token_mean'] * 1e3:.1f} ms, "
        f"{r['prefill_tokens_per_second_mean']:.1f} prompt tokens/s (prompts not seen before)",
    ]
    if r["read_loop_gb_per_s"] is not None:
        share = 100 * r["weight_bandwidth_gb_per_s"] / r["read_loop_gb_per_s"]
        lines.append(f"Plain read loop, best of 3: {r['read_loop_gb_per_s']:.2f} GB/s (decode, {best}, reads weights "
                     f"at {share:.0f}% of it); best torch matmul {r['torch_matmul_gflops']:.1f} GFLOP/s (float32, "
                     "2048 x 2048 x 2048)")
    return "".join(line + "\n" for line in lines)
