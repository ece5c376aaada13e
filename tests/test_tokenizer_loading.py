"""Tokenizer loading: a checkpoint folder without tokenizer files is refused naming the files it lacks and those it
has, not with transformers' advice to install sentencepiece."""
from __future__ import annotations

import shutil

import pytest

from strata.errors import ConfigError
from strata.tokenizer import load_tokenizer


def _copy_without(src, dst, *names):
    shutil.copytree(src, dst)
    for name in names:
        (dst / name).unlink()
    return dst


def test_a_folder_without_tokenizer_files_says_which_are_missing(llama_tied, tmp_path):
    folder = _copy_without(llama_tied, tmp_path / "no_tok", "tokenizer.json", "tokenizer_config.json")
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(str(folder))
    message = caught.value.message
    assert "none of tokenizer.json, tokenizer.model, vocab.json + merges.txt, vocab.txt" in message
    assert "tokenizer files present: none" in message and "--tokenizer" in message
    assert "sentencepiece" not in message


def test_a_config_without_its_vocabulary_names_what_is_there(llama_tied, tmp_path):
    folder = _copy_without(llama_tied, tmp_path / "config_only", "tokenizer.json")
    (folder / "vocab.json").write_text("{}")  # half of a BPE pair is no vocabulary
    with pytest.raises(ConfigError, match=r"tokenizer files present: tokenizer_config.json, vocab.json"):
        load_tokenizer(str(folder))


def test_present_but_unreadable_files_keep_transformers_reason(llama_tied, tmp_path):
    folder = _copy_without(llama_tied, tmp_path / "bad_tok")
    (folder / "tokenizer.json").write_text("not json")
    with pytest.raises(ConfigError, match="cannot load the tokenizer") as caught:
        load_tokenizer(str(folder))
    assert "none of" not in caught.value.message


def test_a_whole_folder_still_loads(llama_tied):
    from transformers import AutoTokenizer

    text = "def add(a, b):\n    return a + b"
    assert load_tokenizer(str(llama_tied))(text).input_ids == AutoTokenizer.from_pretrained(llama_tied)(text).input_ids
