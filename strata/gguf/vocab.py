"""Whether strata can rebuild the tokenizer a GGUF file describes (`tokenizer.ggml.*`), said before transformers
tries: what is missing, by the metadata key that would hold it, instead of the bare KeyError transformers raises."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Tokenizer models whose vocabulary is rebuilt from merges (byte-level BPE), and those whose merges may instead be
# derived from the tokens' scores (SentencePiece BPE), or that are scored pieces (Unigram).
_MERGES_ONLY = ("gpt2",)
_MERGES_OR_SCORES = ("llama", "gemma4")
_SCORES_ONLY = ("t5",)
# Architectures whose SentencePiece merges transformers derives from the tokens' order, not their scores.
_MERGES_FROM_ORDER = ("gemma", "gemma2", "gemma3")


def tokenizer_problem(metadata: Mapping[str, Any]) -> str | None:
    """Why the tokenizer of a GGUF file with this metadata cannot be built, or None when it can."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_TYPES

    model = metadata.get("tokenizer.ggml.model")
    if model is None or not metadata.get("tokenizer.ggml.tokens"):
        return "the file carries no tokenizer (no tokenizer.ggml.model or tokenizer.ggml.tokens)"
    if model == "plamo2":
        return _plamo2_problem(metadata)
    if model not in GGUF_TOKENIZER_TYPES:
        return (f"strata cannot build its tokenizer model {model!r} (tokenizer.ggml.model); it builds "
                f"{', '.join(sorted([*GGUF_TOKENIZER_TYPES, 'plamo2']))}")
    has_merges, has_scores = bool(metadata.get("tokenizer.ggml.merges")), bool(metadata.get("tokenizer.ggml.scores"))
    if model in _MERGES_ONLY and not has_merges:
        return (f"its {model!r} (byte-level BPE) tokenizer has no merges (tokenizer.ggml.merges), without which "
                "neither strata nor llama.cpp can tokenize text")
    from_order = model == "llama" and metadata.get("general.architecture") in _MERGES_FROM_ORDER
    if model in _MERGES_OR_SCORES and not (has_merges or has_scores or from_order):
        return (f"its {model!r} tokenizer has neither merges (tokenizer.ggml.merges) nor token scores "
                "(tokenizer.ggml.scores) to derive them from")
    if model in _SCORES_ONLY and not has_scores:
        return f"its {model!r} (Unigram) tokenizer has no token scores (tokenizer.ggml.scores)"
    return None


def _plamo2_problem(metadata: Mapping[str, Any]) -> str | None:
    """PLaMo2's tokenizer (strata's own, as llama.cpp's) writes characters outside its vocabulary as byte tokens: it
    needs all 256, and llama.cpp refuses the file without them."""
    from strata.plamo2_tokenizer import PlamoVocab, describe_missing_bytes, missing_byte_tokens

    missing = missing_byte_tokens(PlamoVocab.from_gguf(metadata))
    if not missing:
        return None
    return (f"its 'plamo2' vocabulary lacks the byte tokens {describe_missing_bytes(missing)} (pieces `<0xNN>` of "
            "type BYTE in tokenizer.ggml.tokens / tokenizer.ggml.token_type), which its tokenizer writes characters "
            "outside the vocabulary with")
