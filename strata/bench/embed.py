"""`strata bench embed`: sentences/s and tokens/s of an embedding model through LLM.embed, and optionally of
sentence-transformers' encode on the same sentences and threads (rounds alternate, so a shared machine's noise
hits both alike)."""
from __future__ import annotations

import argparse
import json
import logging
import random
import time

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
    parser.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    EngineArgs.add_cli_args(parser)


def random_sentences(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def run_embed(args: argparse.Namespace) -> int:
    from strata import LLM

    sentences = random_sentences(args.num_sentences, args.min_words, args.max_words, args.seed)
    llm = LLM(args.model, **{**engine_kwargs(args), "runner": "pooling"})
    llm.embed(sentences[:64], truncate_prompt_tokens=-1)  # warm-up
    tokens = sum(len(ids) for ids in llm.engine.tokenize(sentences, -1))
    st = _sentence_transformer(args.model) if args.compare_sentence_transformers else None
    if st is not None:
        st.encode(sentences[:64], batch_size=args.st_batch_size)  # warm-up
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        started = time.perf_counter()
        llm.embed(sentences, truncate_prompt_tokens=-1)
        best["strata"] = min(best.get("strata", float("inf")), time.perf_counter() - started)
        if st is not None:
            started = time.perf_counter()
            st.encode(sentences, batch_size=args.st_batch_size)
            best["sentence-transformers"] = min(best.get("sentence-transformers", float("inf")),
                                                time.perf_counter() - started)
    figures = {name: {"seconds": s, "sentences_per_s": len(sentences) / s, "tokens_per_s": tokens / s}
               for name, s in best.items()}
    print(f"Sentences: {len(sentences)} ({args.min_words}-{args.max_words} words), tokens: {tokens}, "
          f"best of {args.rounds} rounds")
    for name, f in figures.items():
        print(f"{name:>22}: {f['sentences_per_s']:.2f} sentences/s, {f['tokens_per_s']:.2f} tokens/s "
              f"({f['seconds']:.2f} s)")
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
