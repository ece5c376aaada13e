"""`strata bench embed`: sentences/s, tokens/s and GFLOP/s of an embedding model through LLM.embed, and optionally of
sentence-transformers' encode, llama.cpp's llama-embedding and torch.mm's float32 GEMM on the same sentences and
threads (rounds alternate, so a shared machine's noise hits all alike)."""
from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

from strata.bench.embed_flops import GemmPeak, encoder_flops
from strata.bench.machine import cpu_model
from strata.config.engine_args import EngineArgs, engine_kwargs

logger = logging.getLogger(__name__)

_WORDS = ("the quick brown fox jumps over a lazy dog while paged attention stores keys and values in blocks of "
          "tokens served by an engine that batches requests continuously across many threads").split()


def add_embed_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="an encoder checkpoint folder (BertModel)")
    parser.add_argument("--num-sentences", type=int, default=1024, help="sentences per round")
    parser.add_argument("--min-words", type=int, default=16, help="fewest words of a sentence")
    parser.add_argument("--max-words", type=int, default=128, help="most words of a sentence")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (the best is reported)")
    parser.add_argument("--compare-sentence-transformers", action="store_true",
                        help="also time sentence-transformers' encode (batch --st-batch-size) in alternate rounds")
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--compare-llama-embedding", default=None, metavar="BINARY",
                        help="also time llama.cpp's llama-embedding (this binary) on --llama-gguf in alternate rounds")
    parser.add_argument("--llama-gguf", default=None,
                        help="the same checkpoint as llama.cpp's convert_hf_to_gguf.py writes it (--outtype f32)")
    parser.add_argument("--gemm-peak", action="store_true",
                        help="also time torch.mm of 2048 squares in each round: the float32 GEMM ceiling on these "
                             "threads, which the GFLOP/s of each engine (BERT-shaped encoders) are read against")
    parser.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    EngineArgs.add_cli_args(parser)


def random_sentences(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def run_embed(args: argparse.Namespace) -> int:
    import torch

    from strata import LLM

    sentences = random_sentences(args.num_sentences, args.min_words, args.max_words, args.seed)
    llm = LLM(args.model, **{**engine_kwargs(args), "runner": "pooling"})
    llm.embed(sentences[:64], truncate_prompt_tokens=-1)  # warm-up
    seq_lens = [len(ids) for ids in llm.engine.tokenize(sentences, -1)]
    tokens, flops = sum(seq_lens), encoder_flops(llm.engine.config.model.text_config, seq_lens)
    timed = {"strata": lambda: _seconds(lambda: llm.embed(sentences, truncate_prompt_tokens=-1))}
    if args.compare_sentence_transformers:
        st = _sentence_transformer(args.model)
        st.encode(sentences[:64], batch_size=args.st_batch_size)  # warm-up
        timed["sentence-transformers"] = lambda: _seconds(lambda: st.encode(sentences, batch_size=args.st_batch_size))
    if args.compare_llama_embedding:
        llama = _llama_embedding(args, llm)
        _check_llama_embeddings(llama, llm, sentences[:64])
        timed["llama-embedding"] = lambda: llama.seconds(sentences)
    peak = GemmPeak() if args.gemm_peak else None
    if peak is not None:
        timed["gemm"] = peak.seconds
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, seconds in timed.items():
            best[name] = min(best.get(name, float("inf")), seconds())
    figures = {name: {"seconds": s, "sentences_per_s": len(sentences) / s, "tokens_per_s": tokens / s,
                      **({"gflops_per_s": flops / s / 1e9} if flops else {})}
               for name, s in best.items() if name != "gemm"}
    if peak is not None:
        figures["gemm_peak"] = {"gflops_per_s": peak.flops / best["gemm"] / 1e9, "what": "torch.mm 2048 x 2048"}
    print(f"Sentences: {len(sentences)} ({args.min_words}-{args.max_words} words), tokens: {tokens}, "
          f"best of {args.rounds} rounds, {torch.get_num_threads()} threads, CPU: {cpu_model()}")
    if flops:
        print(f"Work: {flops / 1e12:.3f} TFLOP without padding")
    for name, f in figures.items():
        rate = f" = {f['gflops_per_s']:.1f} GFLOP/s" if "gflops_per_s" in f else ""
        if name == "gemm_peak":
            print(f"{'float32 GEMM peak':>22}: {f['what']}{rate}")
            continue
        print(f"{name:>22}: {f['sentences_per_s']:.2f} sentences/s, {f['tokens_per_s']:.2f} tokens/s "
              f"({f['seconds']:.2f} s){rate}")
    for name in sorted(timed.keys() - {"strata", "gemm"}):
        print(f"strata / {name}: {best[name] / best['strata']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as out:
            json.dump({"num_sentences": len(sentences), "num_tokens": tokens, **figures}, out, indent=2)
    llm.shutdown()
    return 0


def _sentence_transformer(model: str):  # noqa: ANN202 - an optional dependency's type
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise SystemExit("--compare-sentence-transformers needs `pip install sentence-transformers`") from None
    return SentenceTransformer(model, device="cpu")


def _seconds(work) -> float:  # noqa: ANN001 - a callable
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _llama_embedding(args: argparse.Namespace, llm):  # noqa: ANN001, ANN202 - LLM, LlamaEmbedding
    import torch

    from strata.bench.embed_llama import LlamaEmbedding

    if not args.llama_gguf:
        raise SystemExit("--compare-llama-embedding needs --llama-gguf (the checkpoint converted by llama.cpp's "
                         "convert_hf_to_gguf.py --outtype f32)")
    engine = llm.engine
    budget = max(engine.config.scheduler.max_num_batched_tokens, engine.max_model_len)
    return LlamaEmbedding(Path(args.compare_llama_embedding), Path(args.llama_gguf), torch.get_num_threads(),
                          engine.pooling.mode, engine.pooling.normalize, budget)


def _check_llama_embeddings(llama, llm, sentences: list[str]) -> None:  # noqa: ANN001 - LlamaEmbedding, LLM
    """llama.cpp's embeddings of the same checkpoint should be strata's: the lowest cosine is printed."""
    import torch

    _, theirs = llama.run(sentences)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(sentences, truncate_prompt_tokens=-1)])
    cosine = torch.nn.functional.cosine_similarity(ours, theirs).min().item()
    print(f"llama-embedding vs strata on {len(sentences)} sentences: lowest cosine {cosine:.6f}")
    if cosine < 0.999:
        logger.warning("llama-embedding's vectors differ from strata's (cosine %.4f): is %s this checkpoint?",
                       cosine, llama.gguf)
