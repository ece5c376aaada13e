"""`strata bench latency`: time per output token of one batch after a fixed prompt (vLLM's name), with the
effective weight bandwidth (the bytes of weights a decode step reads over the time it takes), the prefill's rate,
and for scale the machine's plain read loop and best torch matmul."""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch

from strata.bench.throughput import random_prompts
from strata.engine_args import EngineArgs, engine_kwargs
from strata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `strata bench latency`: the batch and its lengths, then every engine option."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--output-json", default=None)
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


def prefill_seconds(llm, prompt_sets: list[list[list[int]]]) -> float:
    """The shortest time to the first token over prompt sets never seen before (the prefix cache holds none)."""
    return min(_timed(llm, prompts, 1) for prompts in prompt_sets)


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    if any(len(o.outputs[0].token_ids) != max_tokens for o in outs):
        raise RuntimeError(f"expected {max_tokens} output tokens per prompt")
    return elapsed


def measure(llm, prompts: list[list[int]], output_len: int, warmup: int, iters: int) -> tuple[list[float], float]:
    """Latencies of `iters` full runs, and the time per output token: the run less its prefill and first
    token (a run with one output token), over the remaining tokens."""
    for _ in range(warmup):
        _timed(llm, prompts, output_len)
    latencies = [_timed(llm, prompts, output_len) for _ in range(iters)]
    first = min(_timed(llm, prompts, 1) for _ in range(max(1, iters)))
    per_token = (min(latencies) - first) / max(1, output_len - 1)
    return latencies, per_token


def _on_cuda(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def cpu_kernels_line(llm) -> str:
    """Which CPU paths the run took: the decode steps each fused path served (an in-process model only) and the
    instruction set the small-batch kernels were built for."""
    from strata.layers.quantization import cpu_matmul, kernel_choice

    model = getattr(getattr(llm.engine.executor, "runner", None), "model", None)
    stack = getattr(model, "decode_stack", None)
    if stack is None:
        paths = "decode path not known here (workers in other processes, or a model without the fused path)"
    else:
        served = stack.served
        paths = (f"{served['whole step']} decode steps in one C call each, {served['stack']} with every layer in "
                 f"one call, {served['blocks']} layer by layer in C blocks, of {llm.engine.stats['steps']} steps")
    line = f"CPU kernels: {paths}; small-batch products built for {cpu_matmul.build()}"
    choice = kernel_choice.summary(_weight_kinds(model)) if model is not None else ""
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
    model = ModelConfig.from_path(resolve_source(EngineArgs.from_cli_args(args, args.model)))
    prompts = random_prompts(args.batch_size, args.input_len, model.vocab_size, args.seed, avoid=model.eos_token_ids)
    nbytes = weight_bytes(args)
    read_loop = None if _on_cuda(args.device) else read_loop_bandwidth()
    llm = LLM(args.model, **engine_kwargs(args))
    try:
        latencies, per_token = measure(llm, prompts, args.output_len, args.num_iters_warmup, args.num_iters)
        fresh = [random_prompts(args.batch_size, args.input_len, model.vocab_size, args.seed + 1 + i,
                                avoid=model.eos_token_ids) for i in range(max(1, args.num_iters))]
        ttft = prefill_seconds(llm, fresh)
        if llm.engine.spec is not None:  # --speculative-config: how the drafts fared
            sys.stdout.write(llm.engine.spec.stats.summary() + "\n")
        if read_loop is not None:
            sys.stdout.write(cpu_kernels_line(llm) + "\n")
    finally:
        llm.shutdown()
    result = {"avg_latency": statistics.mean(latencies), "latencies": latencies, "batch_size": args.batch_size,
              "input_len": args.input_len, "output_len": args.output_len, "time_per_output_token": per_token,
              "output_tokens_per_second": args.batch_size / per_token, "weight_bytes": nbytes,
              "weight_bandwidth_gb_per_s": nbytes / per_token / 1e9,
              "read_loop_gb_per_s": None if read_loop is None else read_loop / 1e9, "time_to_first_token": ttft,
              "prefill_tokens_per_second": args.batch_size * args.input_len / ttft,
              "torch_matmul_gflops": None if read_loop is None else torch_matmul_gflops()}
    sys.stdout.write(f"Avg latency: {result['avg_latency']:.4f} seconds (batch {args.batch_size}, "
                     f"{args.input_len} in, {args.output_len} out)\n"
                     f"Time per output token: {per_token * 1e3:.2f} ms, {result['output_tokens_per_second']:.2f} "
                     f"output tokens/s\n"
                     f"Effective weight bandwidth: {result['weight_bandwidth_gb_per_s']:.2f} GB/s "
                     f"({nbytes / 1e9:.3f} GB of weights read per step)\n")
    sys.stdout.write(f"Prefill: {ttft * 1e3:.1f} ms to the first token, {result['prefill_tokens_per_second']:.1f} "
                     "prompt tokens/s (prompts not seen before)\n")
    if read_loop is not None:
        sys.stdout.write(f"Plain read loop: {read_loop / 1e9:.2f} GB/s (decode reads weights at "
                         f"{100 * nbytes / per_token / read_loop:.0f}% of it); best torch matmul "
                         f"{result['torch_matmul_gflops']:.1f} GFLOP/s (float32, 2048 x 2048 x 2048)\n")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
