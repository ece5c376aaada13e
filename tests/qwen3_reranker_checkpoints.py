"""A tiny random Qwen3-Reranker-like checkpoint (a Qwen3ForCausalLM whose tokenizer adds no special tokens, as Qwen's),
the overrides vLLM serves it with, the model card's templates and its transformers recipe as the oracle."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from arch_checkpoints import make_arch

# The model card's templates, split as vLLM's example splits them: the query side carries the prefix, the document
# side the suffix; vLLM concatenates the two sides' tokens.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: what stores keys and values\n"
DOCS = [f"<Document>: {d}{SUFFIX}" for d in (
    "Paged attention stores keys and values in fixed size blocks.", "def add(a, b):", "import os",
    "The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time there was a small model")]
# The tiny BPE has no "yes" / "no": two of its single tokens answer instead ([false, true] as vLLM orders them).
NO, YES = "import", "Ġquick"
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [NO, YES],
             "is_original_qwen3_reranker": True}


def write_qwen3_reranker(folder: Path) -> Path:
    """A random Qwen3ForCausalLM whose tokenizer adds no special tokens, as Qwen's does (the shared test tokenizer
    opens every text with <s>)."""
    folder = make_arch(folder, "qwen3")
    tokenizer_json = folder / "tokenizer.json"
    tokenizer_json.write_text(json.dumps({**json.loads(tokenizer_json.read_text()), "post_processor": None}))
    return folder


def card_scores(folder, sequences: list[list[int]]) -> torch.Tensor:
    """The card's `compute_logits`: a left-padded batch through AutoModelForCausalLM, log_softmax over the [no, yes]
    logits of the last position, exp of yes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    no, yes = tokenizer.convert_tokens_to_ids([NO, YES])
    batch = tokenizer.pad({"input_ids": sequences}, padding=True, return_tensors="pt")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        last = model(**batch).logits[:, -1, :]
    return torch.log_softmax(torch.stack([last[:, no], last[:, yes]], dim=1), dim=1)[:, 1].exp()


def vllm_pair_tokens(folder, first: str, second: str) -> list[int]:
    """vLLM's pair for a decoder: the tokenizer's text pair, which a Qwen tokenizer concatenates."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    pair = tokenizer(first, second).input_ids
    assert pair == tokenizer(first).input_ids + tokenizer(second).input_ids
    return pair
