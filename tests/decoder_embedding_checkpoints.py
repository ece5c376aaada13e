"""A tiny random Qwen3-Embedding-like checkpoint written by transformers (a bare `Qwen3Model` saved under
`architectures: ["Qwen3ForCausalLM"]`, a tokenizer that appends EOS and pads on the left, sentence-transformers'
last-token + Normalize modules), and the model card's recipe as the oracle: last-token pooling of AutoModel's
hidden states, normalized."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from arch_checkpoints import ARCHITECTURES, COMMON, VOCAB, edit_config
from checkpoints import write_tokenizer

QUERY_INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
TEXTS = [f"{QUERY_INSTRUCTION}quick brown fox", "def add(a, b):\n    return a + b\n", "import os",
         "Paged attention stores keys and values in fixed size blocks. " * 3, "The lazy dog.",
         f"{QUERY_INSTRUCTION}What is paged attention?"]


def write_qwen3_embedding(folder: Path, *, seed: int = 0, matryoshka: bool = True) -> Path:
    from tokenizers import Tokenizer, processors
    from transformers import Qwen3Config, Qwen3Model

    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**{**COMMON, **ARCHITECTURES["qwen3"][2], "tie_word_embeddings": True})
    torch.manual_seed(seed)
    model = Qwen3Model(config)
    with torch.no_grad():  # as arch_checkpoints.make_arch: weights that move the states visibly
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            else:  # the norms (Qwen3 has no biases)
                p.uniform_(0.6, 1.4)
    model.save_pretrained(folder, safe_serialization=True)
    edit_config(folder, architectures=["Qwen3ForCausalLM"], is_matryoshka=matryoshka or None)
    write_tokenizer(folder, VOCAB)
    # Qwen3-Embedding's tokenizer closes every text with <|endoftext|>, the token pooled; here </s> (id 1).
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.update(pad_token="</s>", padding_side="left")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    write_sentence_transformers_files(folder, "last", normalize=True)
    return folder


def write_sentence_transformers_files(folder: Path, mode: str, normalize: bool) -> None:
    keys = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": COMMON["hidden_size"], "include_prompt": True,
               **{key: m == mode for m, key in keys.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


def sentence_transformers_embeddings(folder: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True, batch_size=4)


def model_card_embeddings(folder: Path, texts: list[str]) -> torch.Tensor:
    """Qwen3-Embedding's card: a left-padded batch through AutoModel, the last token's state, L2-normalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"]
    if bool(mask[:, -1].all()):  # left padding: every sequence ends in the last column
        last = hidden[:, -1]
    else:
        last = hidden[torch.arange(hidden.shape[0]), mask.sum(dim=1) - 1]
    return torch.nn.functional.normalize(last, p=2, dim=1)
