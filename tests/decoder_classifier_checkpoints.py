"""Tiny random decoder sequence classifiers written by transformers (Qwen3ForSequenceClassification,
LlamaForSequenceClassification: the decoder under `model.`, the head `score.weight`, no LM head) and transformers'
logits as the oracle."""
from __future__ import annotations

from pathlib import Path

import torch
from arch_checkpoints import ARCHITECTURES, COMMON, VOCAB
from checkpoints import write_tokenizer

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
FAMILIES = {"qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification", ARCHITECTURES["qwen3"][2]),
            "llama": ("LlamaConfig", "LlamaForSequenceClassification", {})}


def write_classifier(folder: Path, family: str, num_labels: int, seed: int = 0) -> Path:
    """A random `Qwen3ForSequenceClassification` / `LlamaForSequenceClassification` (float32) with the shared
    tokenizer, as transformers saves it (decoder under `model.`, head `score.weight`, no LM head)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config_class, model_class, extra = FAMILIES[family]
    labels = {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}} if num_labels == 3 else {}
    config = getattr(transformers, config_class)(**{**COMMON, **extra, "num_labels": num_labels, **labels})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # weights that move the states (and the logits) visibly
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() >= 2 else p.uniform_(0.6, 1.4)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, VOCAB)
    return folder


def transformers_logits(folder: Path, prompts: list[list[int]]) -> torch.Tensor:
    """AutoModelForSequenceClassification's logits, one unpadded prompt at a time (its last token pooled)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(torch.tensor([ids])).logits for ids in prompts])
