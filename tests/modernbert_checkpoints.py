"""Tiny random-weight ModernBertModel checkpoints written by transformers (BERT's WordPiece tokenizer over the test
corpus), with a sentence-transformers pipeline beside them; optionally rewritten in the older config.json keys."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from bert_checkpoints import _bert_tokenizer, _vocab, _write_sentence_transformers


def write_modernbert_checkpoint(folder: Path, pooling: str = "mean", normalize: bool = True, *, biases: bool = False,
                                old_config_keys: bool = False, local_attention: int = 8, max_positions: int = 128,
                                seed: int = 0) -> Path:
    """Four layers (global, local, local, global), RoPE thetas of 1000 (global) and 50 (local), a window of
    `local_attention` tokens; `biases` turns on the attention, MLP and norm biases."""
    from transformers import ModernBertConfig, ModernBertModel

    folder.mkdir(parents=True, exist_ok=True)
    _bert_tokenizer(folder, max_positions)
    config = ModernBertConfig(vocab_size=len(_vocab()), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, max_position_embeddings=max_positions,
                              local_attention=local_attention, global_attn_every_n_layers=3,
                              global_rope_theta=1000.0, local_rope_theta=50.0, pad_token_id=0, cls_token_id=2,
                              sep_token_id=3, bos_token_id=2, eos_token_id=3, attention_bias=biases, mlp_bias=biases,
                              norm_bias=biases)
    torch.manual_seed(seed)
    model = ModernBertModel(config)
    with torch.no_grad():  # larger than the init, norms and biases away from 1 / 0: each layer changes the states
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.6, 1.4)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    if old_config_keys:
        _rewrite_old_keys(folder / "config.json")
    _write_sentence_transformers(folder, pooling, normalize, 64, max_positions)
    return folder


def _rewrite_old_keys(path: Path) -> None:
    """config.json as the Hub's ModernBERT checkpoints write it (transformers 4): the layer pattern as an interval,
    the two thetas as keys of their own."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(global_attn_every_n_layers=3, global_rope_theta=rope["full_attention"]["rope_theta"],
                  local_rope_theta=rope["sliding_attention"]["rope_theta"])
    path.write_text(json.dumps(config, indent=2))
