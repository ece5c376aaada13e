"""`strata bench throughput`: offline throughput on random prompts, printed like vLLM's."""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time

from strata.engine_args import EngineArgs, engine_kwargs
from strata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `strata bench throughput`: the workload, then every engine option."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--backend", default="strata", choices=["strata", "hf"],
                        help="hf: transformers generate() with one static batch, as a baseline")
    EngineArgs.add_cli_args(parser)


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0,
                   avoid: set[int] = frozenset()) -> list[list[int]]:
    rng = random.Random(seed)
    choices = [t for t in range(vocab_size) if t not in avoid]
    return [[rng.choice(choices) for _ in range(input_len)] for _ in range(num_prompts)]


def _bench_strata(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, float]:
    from strata.llm import LLM

    started = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    warm = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2), use_tqdm=False)
    load_to_first_token = time.perf_counter() - started
    assert warm[0].finished
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != args.output_len * len(prompts):
        raise RuntimeError(f"expected {args.output_len * len(prompts)} output tokens, got {produced}")
    llm.shutdown()
    return elapsed, load_to_first_token


def _bench_hf(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, float]:
    """transformers generate() with one static batch of every prompt, the baseline vLLM also offers."""
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype, "auto")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    load = time.perf_counter() - started
    ids = torch.tensor(prompts)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                             max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=0)
    elapsed = time.perf_counter() - started
    assert out.shape[1] == args.input_len + args.output_len
    return elapsed, load


def bench_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The token ids `strata bench throughput` feeds for these flags (also what baselines must be given)."""
    from strata.config import ModelConfig

    model = ModelConfig.from_path(args.model)
    return random_prompts(args.num_prompts, args.input_len, model.vocab_size, args.seed, avoid=model.eos_token_ids)


def run_throughput(args: argparse.Namespace) -> int:
    prompts = bench_prompts(args)
    backend = getattr(args, "backend", "strata")
    elapsed, load = (_bench_hf if backend == "hf" else _bench_strata)(args, prompts)
    total = args.num_prompts * (args.input_len + args.output_len)
    output = args.num_prompts * args.output_len
    result = {"backend": backend, "elapsed_time": elapsed, "num_requests": args.num_prompts,
              "total_num_tokens": total, "requests_per_second": args.num_prompts / elapsed,
              "tokens_per_second": total / elapsed, "output_tokens_per_second": output / elapsed,
              "load_to_first_token_s": load}
    sys.stdout.write(f"Throughput: {args.num_prompts / elapsed:.2f} requests/s, {total / elapsed:.2f} total "
                     f"tokens/s, {output / elapsed:.2f} output tokens/s\n"
                     f"Model load to first token: {load:.2f} s ({backend})\n")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
