"""`strata bench speculative`: output tokens/s on the input-grounded workload (strata.bench.grounded) without
speculation and with each speculative method, at each concurrency; greedy, so every method must produce the same
tokens, which is checked and reported."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from strata.bench.grounded import grounded_prompts
from strata.config.engine_args import EngineArgs, engine_kwargs
from strata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

METHODS = ("none", "ngram", "suffix")


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `strata bench speculative`: the workload and methods, then every engine option (a
    --speculative-config given there is run as one more method, "custom")."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per concurrency level (at least as "
                                                                   "many as the concurrency)")
    parser.add_argument("--output-len", type=int, default=256, help="most tokens per output (greedy, to EOS)")
    parser.add_argument("--max-input-len", type=int, default=1024, help="prompts longer than this are skipped")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--num-speculative-tokens", type=int, default=8, help="for ngram; suffix drafts up to 2x")
    parser.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(parser)


def method_config(method: str, k: int) -> dict[str, Any] | None:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 2 * k}
    return None


def run_concurrent(engine: Any, prompts: list[list[int]], concurrency: int, params: SamplingParams
                   ) -> tuple[float, list[list[int]]]:
    """Seconds to serve every prompt keeping `concurrency` requests running, and each output's token ids."""
    outputs: dict[str, list[int]] = {}
    pending = [(str(i), p) for i, p in enumerate(prompts)]
    running = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and running < concurrency:
            request_id, prompt = pending.pop(0)
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            running += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                running -= 1
    elapsed = time.perf_counter() - started
    return elapsed, [outputs[str(i)] for i in range(len(prompts))]


def run_speculative(args: argparse.Namespace) -> int:
    from strata.bench.activations import activations_line
    from strata.llm import LLM

    options = engine_kwargs(args)
    methods = {m: method_config(m, args.num_speculative_tokens) for m in args.methods}
    if options.pop("speculative_config") is not None:
        methods["custom"] = args.speculative_config
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    results: list[dict[str, Any]] = []
    baseline: dict[int, tuple[float, list[list[int]]]] = {}
    for method, config in methods.items():
        llm = LLM(args.model, speculative_config=config, **options)
        # Other prompts at each level: the suffix method's cache of earlier outputs must not recall a level's answers.
        prompts_by_level = {c: grounded_prompts(llm.get_tokenizer(), max(args.num_prompts, c), args.seed + c,
                                                args.max_input_len) for c in args.concurrency}
        run_concurrent(llm.engine, prompts_by_level[args.concurrency[0]][:1], 1, SamplingParams(max_tokens=4))
        sys.stdout.write(activations_line(llm))
        for level in args.concurrency:
            spec = llm.engine.spec
            before = spec.stats.copy() if spec is not None else None
            elapsed, outputs = run_concurrent(llm.engine, prompts_by_level[level], level, params)
            produced = sum(len(o) for o in outputs)
            row = {"method": method, "concurrency": level, "output_tokens": produced, "elapsed_s": elapsed,
                   "output_tokens_per_s": produced / elapsed, "num_outputs": len(outputs)}
            if spec is not None:
                stats = spec.stats.since(before)
                row.update(acceptance_rate=stats.acceptance_rate, mean_acceptance_length=stats.mean_acceptance_length)
                if getattr(spec.proposer, "forwards", 0):  # a draft model: what its passes cost
                    row["draft_pass_ms"] = 1e3 * spec.proposer.mean_pass_s
            if method == "none":
                baseline[level] = (produced / elapsed, outputs)
            elif level in baseline:
                row["speedup"] = row["output_tokens_per_s"] / baseline[level][0]
                row["same_tokens_as_none"] = outputs == baseline[level][1]
                row["same_outputs"] = sum(a == b for a, b in zip(outputs, baseline[level][1], strict=True))
            results.append(row)
            sys.stdout.write(_line(row))
        llm.shutdown()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _line(row: dict[str, Any]) -> str:
    text = (f"{row['method']:>7} x{row['concurrency']:<3} {row['output_tokens_per_s']:8.2f} output tokens/s "
            f"({row['output_tokens']} tokens in {row['elapsed_s']:.2f} s)")
    if "acceptance_rate" in row:
        text += (f", acceptance rate {100 * row['acceptance_rate']:.1f}%, mean acceptance length "
                 f"{row['mean_acceptance_length']:.2f}")
    if "draft_pass_ms" in row:
        text += f", {row['draft_pass_ms']:.2f} ms per draft pass"
    if "speedup" in row:
        text += f", {row['speedup']:.2f}x none, same tokens: {row['same_tokens_as_none']}"
        if not row["same_tokens_as_none"]:
            text += f" ({row['same_outputs']} of {row['num_outputs']} outputs)"
    return text + "\n"
