"""`strata bench throughput`: offline throughput on random prompts, printed like vLLM's."""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

from strata.bench.lora import add_lora_bench_args, bench_lora_requests, decode_path_line
from strata.config.engine_args import EngineArgs, engine_kwargs
from strata.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `strata bench throughput`: the workload, then every engine option."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--json-schema", default=None,
                        help="run every prompt under this JSON schema: 'default' (lists of 20-property "
                             "records), a file or inline JSON")
    parser.add_argument("--backend", default="strata", choices=["strata", "hf"],
                        help="hf: transformers generate() with one static batch, as a baseline")
    add_lora_bench_args(parser)
    EngineArgs.add_cli_args(parser)


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0,
                   avoid: set[int] = frozenset()) -> list[list[int]]:
    rng = random.Random(seed)
    choices = [t for t in range(vocab_size) if t not in avoid]
    return [[rng.choice(choices) for _ in range(input_len)] for _ in range(num_prompts)]


def _bench_strata(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, float]:
    from strata.bench.activations import activations_line
    from strata.llm import LLM

    loras = bench_lora_requests(args, len(prompts))
    started = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    warm = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2), use_tqdm=False)
    load_to_first_token = time.perf_counter() - started
    assert warm[0].finished
    schema = _json_schema(getattr(args, "json_schema", None))
    sys.stdout.write(activations_line(llm))
    if schema is None:
        elapsed, _ = _timed_run(llm, prompts, args.output_len, None, loras)
        sys.stdout.write(decode_path_line(llm, loras))
        if llm.engine.spec is not None:  # --speculative-config: how the drafts fared
            sys.stdout.write(llm.engine.spec.stats.summary() + "\n")
        llm.shutdown()
        return elapsed, load_to_first_token
    constraint = StructuredOutputsParams(json=schema)
    sys.stdout.write(structured_figures(llm, constraint, prompts))  # also warms every batch shape up
    plain, _ = _timed_run(llm, prompts, args.output_len, None, loras)
    elapsed, _ = _timed_run(llm, prompts, args.output_len, constraint, loras)
    filler = llm.engine.grammars.filler
    sys.stdout.write(f"Unconstrained run in the same engine: {plain:.2f} s; constrained: {elapsed:.2f} s "
                     f"({plain / elapsed:.2f}x the unconstrained throughput); bitmask fill "
                     f"{1e3 * filler.mean_fill_s:.2f} ms per step on average, {filler.max_rows} rows at most\n")
    args.unconstrained_elapsed = plain
    llm.shutdown()
    return elapsed, load_to_first_token


def _timed_run(llm: Any, prompts: list[list[int]], output_len: int, constraint: StructuredOutputsParams | None,
               loras: list | None = None) -> tuple[float, int]:
    """Seconds for every prompt to produce output_len tokens (each under `constraint` when given, each with its
    LoRA adapter of `loras`)."""
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True,
                            structured_outputs=constraint)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True, lora_request=loras)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != output_len * len(prompts):  # a schema that lets JSON end early would compare unlike work
        raise RuntimeError(f"expected {output_len * len(prompts)} output tokens, got {produced}")
    return elapsed, produced


# Every prompt's default schema: at least 20 records of 20 properties, so every output runs to output_len.
DEFAULT_SCHEMA = {"type": "array", "minItems": 20, "items": {
    "type": "object", "required": [f"f{i}" for i in range(20)],
    "properties": {f"f{i}": [{"type": "integer"}, {"type": "string", "maxLength": 12}, {"type": "boolean"},
                             {"enum": ["red", "green", "blue"]}][i % 4] for i in range(20)}}}


def _json_schema(value: str | None) -> dict | None:
    """--json-schema: 'default', a JSON file or inline JSON."""
    if value is None:
        return None
    if value == "default":
        return DEFAULT_SCHEMA
    text = Path(value).read_text() if Path(value).is_file() else value
    return json.loads(text)


def structured_figures(llm: Any, constraint: StructuredOutputsParams, prompts: list[list[int]]) -> str:
    """First and cached compile time of the schema, and the time to first token of a request under a schema
    compiled for it while 64 unconstrained requests run."""
    compiler = llm.engine.grammars.compiler
    compiler.compile(StructuredOutputsParams(regex="warm"))  # the tokenizer info is built once per engine
    started = time.perf_counter()
    compiler.compile(constraint)
    first = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(constraint)
    cached = time.perf_counter() - started
    engine = llm.engine
    busy = SamplingParams(max_tokens=64, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"busy-{i}", {"prompt_token_ids": prompts[i % len(prompts)]}, busy)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()  # every prompt prefilled: the 64 are decoding
    fresh = StructuredOutputsParams(json={**DEFAULT_SCHEMA, "minItems": 1})  # not compiled yet
    started = time.perf_counter()
    probe = SamplingParams(max_tokens=4, structured_outputs=fresh)
    engine.add_request("probe", {"prompt_token_ids": prompts[0]}, probe)
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "probe" and ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - started
    return (f"Schema compile: first {1e3 * first:.1f} ms, cached {1e3 * cached:.3f} ms\n"
            f"Time to first token of a request under a new schema while 64 others run: {1e3 * ttft:.0f} ms\n")


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
    from strata.config import ModelConfig, resolve_source

    model = ModelConfig.from_path(resolve_source(EngineArgs.from_cli_args(args, args.model)))
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
    if getattr(args, "unconstrained_elapsed", None):
        result["unconstrained_elapsed_time"] = args.unconstrained_elapsed
        result["constrained_to_unconstrained_throughput"] = args.unconstrained_elapsed / elapsed
    sys.stdout.write(f"Throughput: {args.num_prompts / elapsed:.2f} requests/s, {total / elapsed:.2f} total "
                     f"tokens/s, {output / elapsed:.2f} output tokens/s\n"
                     f"Model load to first token: {load:.2f} s ({backend})\n")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
