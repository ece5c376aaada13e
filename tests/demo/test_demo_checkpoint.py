"""The shipped strata-demo checkpoint loads, is small, and writes Python-looking text; tokenizer training."""
from __future__ import annotations

import math
import re

import pytest
import torch

import strata.demo
from strata.demo import DEMO_MODEL_NAME, demo_checkpoint_path
from strata.demo.train import (
    ASSISTANT,
    BOS,
    EOS,
    SPECIAL_TOKENS,
    USER,
    chat_examples,
    train_tokenizer,
)
from strata.errors import ConfigError

PYTHON_SNIPPET = (
    "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):\n        self.path = path\n\n"
    "    def read(self):\n        with open(self.path) as f:\n            return f.read()\n"
)


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_checkpoint_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    # float32 so that greedy decoding does not hinge on bf16 rounding of this CPU's kernels.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer


def _greedy(model, tokenizer, prompt: str, n: int = 20) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_checkpoint_folder_is_complete_and_small():
    path = demo_checkpoint_path()
    assert DEMO_MODEL_NAME == "strata-demo"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in path.iterdir() if p.is_file()) < 10 * 2**20


def test_missing_checkpoint_says_how_to_rebuild(monkeypatch, tmp_path):
    monkeypatch.setattr(strata.demo, "_CHECKPOINT_DIR", tmp_path / "absent")
    with pytest.raises(ConfigError, match="strata.demo.train"):
        demo_checkpoint_path()


def test_config_is_a_tiny_tied_gqa_llama(demo):
    model, tokenizer = demo
    cfg = model.config
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.vocab_size == len(tokenizer)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)


def test_chat_template_renders_turns_and_generation_prompt(demo):
    _, tokenizer = demo
    assert tokenizer.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add two numbers."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(BOS) and text.endswith(ASSISTANT)
    assert f"{USER}Add two numbers.{EOS}" in text
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not plain.endswith(ASSISTANT)


def test_tokenizer_round_trips_and_prepends_bos(demo):
    _, tokenizer = demo
    text = "def f(x):\n    return {'ü': x ** 2}  # naïve — 😀\n\tpass"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids[1:]
    for token in SPECIAL_TOKENS:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1


def test_model_predicts_python_far_better_than_chance(demo):
    model, tokenizer = demo
    ids = tokenizer(PYTHON_SNIPPET, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    # Random weights sit near ln(vocab) ~ 7.6 nats; the trained toy is far below.
    assert loss < 0.5 * math.log(model.config.vocab_size), loss


def test_greedy_generation_looks_like_python(demo):
    model, tokenizer = demo
    after_def = _greedy(model, tokenizer, "def ")
    # A function name, its parameter list opening, and more than a couple of distinct characters.
    assert re.match(r"[A-Za-z_]\w*\(", after_def), after_def
    assert len(set(after_def)) > 5, after_def
    after_class = _greedy(model, tokenizer, "class Reader:\n    def ")
    assert re.match(r"[A-Za-z_]\w*\(", after_class), after_class
    after_import = _greedy(model, tokenizer, "import os\n")
    assert re.search(r"\b(import|from|def|class|self|return)\b", after_import), after_import


def test_train_tokenizer_on_tiny_corpus():
    corpus = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
              "class A:\n    def f(self):\n        return self.x\n"] * 10
    tokenizer = train_tokenizer(corpus, vocab_size=300)
    again = train_tokenizer(corpus, vocab_size=300)
    assert tokenizer.get_vocab() == again.get_vocab()
    assert len(tokenizer) <= 300
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    text = "def add(self, b):\n    return self.x + b  # é\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode())  # merges were learned
    # Spaces stay with the word before them, so a prompt ending in "def " ends in a token seen in training.
    assert tokenizer.convert_ids_to_tokens(tokenizer("def ")["input_ids"]) == [BOS, "defĠ"]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == f"{BOS}{USER}hi{EOS}{ASSISTANT}"


def test_chat_examples_ask_for_stdlib_functions_by_name():
    source = "def gather(items, key=None):\n    '''Collect items.'''\n    return sorted(items, key=key)\n"
    conversations = chat_examples([source, "def broken(:\n"], max_chars=10_000, seed=0)
    assert len(conversations) == 1
    roles = [m["role"] for m in conversations[0]]
    assert roles[-2:] == ["user", "assistant"]
    assert "gather" in conversations[0][-2]["content"]
    assert conversations[0][-1]["content"] == source.rstrip("\n")
