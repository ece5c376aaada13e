"""Builders of tiny random-weight checkpoints (config.json + safetensors + a real trained tokenizer)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "Once upon a time there was a small model that served tokens very quickly.",
    "class Engine:\n    def step(self):\n        pass\n",
    "Paged attention stores keys and values in fixed size blocks.",
] * 20

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.cache
def _tokenizer_files(vocab_size: int) -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config)}


def write_chat_tokenizer(folder: Path, special: list[str], plain: list[str], chat_template: str, eos: str):
    """The 512-token BPE with `special` added as special tokens and `plain` as added text tokens, `chat_template` and
    `eos`, saved in `folder` and loaded with transformers."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_str(_tokenizer_files(512)["tokenizer.json"])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    (folder / "tokenizer.json").write_text(tok.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": eos,
              "pad_token": "</s>", "chat_template": chat_template, "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(folder)


def write_tokenizer(folder: Path, vocab_size: int = 320) -> None:
    for name, text in _tokenizer_files(vocab_size).items():
        (folder / name).write_text(text)


def make_llama(folder: Path, *, vocab_size: int = 320, hidden_size: int = 64, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128, tied: bool = False,
               rope_scaling: dict | None = None, max_position_embeddings: int = 512, seed: int = 0,
               dtype: torch.dtype = torch.float32, **extra) -> Path:
    """A random LlamaForCausalLM saved by transformers, with a BPE tokenizer of `vocab_size` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         intermediate_size=intermediate_size, tie_word_embeddings=tied,
                         max_position_embeddings=max_position_embeddings, bos_token_id=0, eos_token_id=1,
                         rope_scaling=rope_scaling, **extra)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # larger weights than the default init, so tokens differ sharply
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, vocab_size)
    return folder
