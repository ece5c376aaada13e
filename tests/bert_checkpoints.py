"""Tiny random-weight BERT checkpoints written by transformers, with a sentence-transformers pipeline beside them."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from checkpoints import CORPUS

_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}


def _vocab() -> list[str]:
    words = sorted({w for text in CORPUS for w in re.findall(r"\w+|[^\w\s]", text.lower())})
    pieces = sorted({"##" + c for w in words for c in w} | {c for w in words for c in w})
    return _SPECIALS + sorted(set(words) | set(pieces))


def _bert_tokenizer(folder: Path, max_positions: int) -> None:
    """A WordPiece tokenizer over the corpus (its vocabulary given whole: transformers 5 ignores `vocab_file`)."""
    from transformers import BertTokenizerFast

    vocab = {token: i for i, token in enumerate(_vocab())}
    BertTokenizerFast(vocab=vocab, do_lower_case=True, model_max_length=max_positions).save_pretrained(folder)


def write_bert_checkpoint(folder: Path, pooling: str | None = "mean", normalize: bool = True, hidden: int = 64,
                          layers: int = 2, heads: int = 4, intermediate: int = 128, max_positions: int = 64,
                          seed: int = 0, **config_extra) -> Path:
    """A BertModel (float32) with its WordPiece tokenizer; with `pooling`, modules.json + 1_Pooling (+ 2_Normalize)
    as sentence-transformers writes them."""
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    _bert_tokenizer(folder, max_positions)
    config = BertConfig(vocab_size=len(_vocab()), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=intermediate,
                        max_position_embeddings=max_positions, **config_extra)
    model = BertModel(config)
    _randomize(model, seed)
    model.save_pretrained(folder)
    if pooling is not None:
        _write_sentence_transformers(folder, pooling, normalize, hidden, max_positions)
    return folder


def _write_sentence_transformers(folder: Path, pooling: str, normalize: bool, hidden: int,
                                 max_positions: int) -> None:
    """modules.json + 1_Pooling (+ 2_Normalize) as sentence-transformers writes them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pool = {"word_embedding_dimension": hidden, **{key: mode == pooling for mode, key in _POOLING_KEYS.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_positions,
                                                                  "do_lower_case": False}))


def _randomize(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():  # larger than the 0.02 init, so that layers change the states visibly
        for p in model.parameters():
            p.normal_(0.0, 0.2)


def _xlm_roberta_tokenizer(folder: Path, max_positions: int):
    """A Unigram (sentencepiece-style) XLM-R tokenizer over the corpus' words and characters."""
    from transformers import XLMRobertaTokenizer

    words = sorted({w for text in CORPUS for w in re.findall(r"\w+|[^\w\s]", text)})
    chars = sorted({c for w in words for c in w})
    specials = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("<mask>", 0.0)]
    vocab = specials + [("▁" + w, -2.0) for w in words] + [(c, -6.0) for c in chars] + [("▁", -4.0)]
    tokenizer = XLMRobertaTokenizer(vocab=vocab, model_max_length=max_positions)
    tokenizer.save_pretrained(folder)
    return tokenizer


def write_cross_encoder_checkpoint(folder: Path, family: str = "bert", num_labels: int = 1, hidden: int = 64,
                                   layers: int = 2, heads: int = 4, intermediate: int = 128, max_positions: int = 64,
                                   seed: int = 0, **config_extra) -> Path:
    """A random-weight `BertForSequenceClassification` or `XLMRobertaForSequenceClassification` (float32) with
    its tokenizer, as transformers writes them (what sentence-transformers' CrossEncoder loads)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    sizes = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 intermediate_size=intermediate, num_labels=num_labels, **config_extra)
    if family == "bert":
        _bert_tokenizer(folder, max_positions)
        config = transformers.BertConfig(vocab_size=len(_vocab()), max_position_embeddings=max_positions, **sizes)
        model = transformers.BertForSequenceClassification(config)
    else:
        tokenizer = _xlm_roberta_tokenizer(folder, max_positions)
        # Positions start after the padding id (1): the table holds two more entries than tokens.
        config = transformers.XLMRobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=max_positions + 2,
                                               pad_token_id=1, bos_token_id=0, eos_token_id=2, **sizes)
        model = transformers.XLMRobertaForSequenceClassification(config)
    _randomize(model, seed)
    model.save_pretrained(folder)
    return folder


def write_xlm_roberta_checkpoint(folder: Path, pooling: str = "mean", hidden: int = 64, layers: int = 2,
                                 heads: int = 4, intermediate: int = 128, max_positions: int = 64,
                                 seed: int = 0) -> Path:
    """A random-weight `XLMRobertaModel` with its tokenizer and a normalized sentence-transformers pipeline."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _xlm_roberta_tokenizer(folder, max_positions)
    config = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=heads, intermediate_size=intermediate,
                              max_position_embeddings=max_positions + 2, pad_token_id=1, bos_token_id=0,
                              eos_token_id=2)
    model = XLMRobertaModel(config)
    _randomize(model, seed)
    model.save_pretrained(folder)
    _write_sentence_transformers(folder, pooling, True, hidden, max_positions)
    return folder
