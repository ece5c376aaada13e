"""`strata bench perplexity`: a text's perplexity under a model, computed as llama.cpp's `llama-perplexity` does (the
text tokenized once, chunks of --ctx tokens, BOS first in each when the vocabulary adds one, the second half scored),
with the log-probs taken from the engine's `prompt_logprobs`, so that figures compare across quantizations and tools."""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.bench.machine import machine_line
from strata.config.engine_args import EngineArgs, engine_kwargs
from strata.errors import ConfigError, UnsupportedModelError
from strata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def add_perplexity_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `strata bench perplexity`: the model (positional or --model), the text and its chunking, then
    every engine option."""
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint folder, .gguf file or Hub ID (or --model)")
    parser.add_argument("--model", default=None, help="the model, as the positional MODEL")
    parser.add_argument("--text", required=True, help="a UTF-8 text file (llama-perplexity's -f)")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    parser.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    parser.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    EngineArgs.add_cli_args(parser)


@dataclass(frozen=True)
class Perplexity:
    """The figures llama-perplexity prints: the running estimate after each chunk, the final one and its error."""

    running: list[float]
    ppl: float
    error: float | None  # None where llama.cpp reports an unexpected negative variance
    scored_tokens: int


def read_text(path: str) -> str:
    """The file's text as llama.cpp's `-f` reads it: whole, less one trailing newline."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"--text {path!r} does not exist", param="text") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"--text {path!r} is not UTF-8 text: {e}", param="text") from e
    return text[:-1] if text.endswith("\n") else text


def tokenize_text(tokenizer: Any, text: str) -> tuple[list[int], int | None]:
    """The text's tokens as llama.cpp's `common_tokenize(ctx, text, add_special=true, parse_special=false)` gives
    them: special-token spellings in the text are plain text, and BOS comes first when the vocabulary adds one
    (what the tokenizer does with special tokens on: a GGUF file's `tokenizer.ggml.add_bos_token`, a checkpoint's
    post-processor). Also the BOS id in that case, else None."""
    plain = tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
    special = tokenizer(text, add_special_tokens=True, split_special_tokens=True).input_ids
    bos = tokenizer.bos_token_id
    if special == plain:
        return plain, None
    if bos is not None and special == [bos, *plain]:
        return special, bos
    # llama-perplexity asserts the vocabulary adds no EOS; any other addition is as far from its algorithm.
    raise UnsupportedModelError("the tokenizer adds special tokens other than a leading BOS "
                                f"({special[:3]}...{special[-3:]} against {plain[:3]}...{plain[-3:]}); "
                                "llama-perplexity's algorithm is defined for BOS only", param="model")


def chunk_prompts(tokens: list[int], ctx: int, chunks: int | None, bos: int | None) -> list[list[int]]:
    """Consecutive, non-overlapping chunks of `ctx` tokens (a remainder shorter than ctx is left out), at most
    `chunks` of them, each with its first token replaced by BOS when the vocabulary adds one."""
    if len(tokens) < 2 * ctx:
        raise ConfigError(f"you need at least {2 * ctx} tokens to evaluate perplexity with a context of {ctx}; the "
                          f"text tokenizes to only {len(tokens)} tokens", param="text")
    count = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    prompts = [tokens[i * ctx:(i + 1) * ctx] for i in range(count)]
    if bos is not None:
        for prompt in prompts:
            prompt[0] = bos
    return prompts


def score_chunks(llm: Any, prompts: list[list[int]], first: int, use_tqdm: bool = True) -> list[list[float]]:
    """Each chunk's negative log-likelihoods of its tokens first + 1 .. ctx - 1, each given the tokens before it in
    the chunk: `prompt_logprobs=0` returns the log-prob of the prompt's own token at every position (float32
    log-softmax over the whole vocabulary), and the engine batches the chunks as its token budget allows."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=use_tqdm)
    scored = []
    for prompt, out in zip(prompts, outs, strict=True):
        positions = out.prompt_logprobs
        scored.append([-positions[i][prompt[i]].logprob for i in range(first + 1, len(prompt))])
    return scored


def perplexity(scored: list[list[float]]) -> Perplexity:
    """llama.cpp's sums: exp of the mean NLL after each chunk, then the final one with the standard error of the
    mean NLL carried to the PPL (sqrt(var / (n - 1)) * PPL)."""
    nll = nll2 = 0.0
    count = 0
    running = []
    for values in scored:
        nll += math.fsum(values)
        nll2 += math.fsum(v * v for v in values)
        count += len(values)
        running.append(math.exp(nll / count))
    mean = nll / count
    variance = nll2 / count - mean * mean
    ppl = math.exp(mean)
    error = math.sqrt(variance / (count - 1)) * ppl if variance > 0 and count > 1 else None
    return Perplexity(running, ppl, error, count)


def _model(args: argparse.Namespace) -> str:
    if args.model and args.model_positional and args.model != args.model_positional:
        raise ConfigError(f"two models given: {args.model_positional!r} and --model {args.model!r}", param="model")
    model = args.model or args.model_positional
    if model is None:
        raise ConfigError("name the model: strata bench perplexity MODEL --text FILE", param="model")
    return model


def _check_sizes(args: argparse.Namespace) -> None:
    if args.ctx < 4:
        raise ConfigError(f"--ctx must be at least 4 (half of it is scored), got {args.ctx}", param="ctx")
    if args.chunks is not None and args.chunks < 1:
        raise ConfigError(f"--chunks must be at least 1, got {args.chunks}", param="chunks")
    if args.max_model_len is not None and args.max_model_len < args.ctx + 1:
        raise ConfigError(f"--max-model-len must be at least --ctx + 1 ({args.ctx + 1}): each chunk is a prompt of "
                          "ctx tokens and one generated token", param="max_model_len")


def run_perplexity(args: argparse.Namespace) -> int:
    from strata.llm import LLM

    model = _model(args)
    _check_sizes(args)
    text = read_text(args.text)
    kwargs = engine_kwargs(args)
    if kwargs["max_model_len"] is None:  # a chunk and the one token generated after it; less KV cache per request
        kwargs["max_model_len"] = args.ctx + 1
    llm = LLM(model, **kwargs)
    try:
        out = sys.stdout
        out.write("perplexity: tokenizing the input ..\n")
        started = time.perf_counter()
        tokens, bos = tokenize_text(llm.get_tokenizer(), text)
        out.write(f"perplexity: tokenization took {(time.perf_counter() - started) * 1e3:g} ms\n")
        prompts = chunk_prompts(tokens, args.ctx, args.chunks, bos)
        batch = llm.engine.config.scheduler.max_num_batched_tokens
        out.write(f"perplexity: calculating perplexity over {len(prompts)} chunks, n_ctx={args.ctx}, "
                  f"batch_size={batch}, n_seq={max(1, batch // args.ctx)}\n")
        started = time.perf_counter()
        scored = score_chunks(llm, prompts, args.ctx // 2)
        seconds = time.perf_counter() - started
    finally:
        llm.shutdown()
    result = perplexity(scored)
    _report(args, result, len(tokens), len(prompts), bos is not None, seconds)
    return 0


def _report(args: argparse.Namespace, result: Perplexity, num_tokens: int, num_chunks: int, add_bos: bool,
            seconds: float) -> None:
    out = sys.stdout
    out.write("".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(result.running)) + "\n")
    error = f" +/- {result.error:.5f}" if result.error is not None else " (unexpected negative variance of log(prob))"
    out.write(f"Final estimate: PPL = {result.ppl:.4f}{error}\n")
    evaluated = num_chunks * args.ctx
    out.write(f"Text: {num_tokens} tokens (BOS {'added, and first in every chunk' if add_bos else 'not added'}); "
              f"{num_chunks} chunks of {args.ctx}, {result.scored_tokens} tokens scored "
              f"({args.ctx - args.ctx // 2 - 1} per chunk)\n")
    out.write(f"Evaluated {evaluated} tokens in {seconds:.2f} s, {evaluated / seconds:.1f} tokens/s\n")
    out.write(machine_line(args.device) + "\n")
    if args.output_json:
        summary = {"perplexity": result.ppl, "error": result.error, "running": result.running,
                   "num_tokens": num_tokens, "add_bos": add_bos, "ctx": args.ctx, "num_chunks": num_chunks,
                   "scored_tokens": result.scored_tokens, "seconds": seconds}
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
