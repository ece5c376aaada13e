"""A GGUF file whose tokenizer strata cannot build is refused naming what is missing (the metadata key, or PLaMo2's
byte tokens), before transformers fails on it with a bare KeyError; a tokenizer passed beside the file still serves
it."""
from __future__ import annotations

import re

import pytest
from checkpoints import write_tokenizer
from llama_cpp_gguf import convert
from mamba_checkpoints import make_mamba2

from strata import LLM, SamplingParams
from strata.errors import ConfigError
from strata.gguf.reader import read_metadata
from strata.gguf.vocab import tokenizer_problem


def test_mamba2_file_whose_bpe_tokenizer_has_no_merges_is_refused_naming_the_merges(tmp_path):
    """make_mamba2's 256-token BPE is its byte alphabet and special tokens alone: trained, it learned no merges, and
    the converter writes none."""
    hf = make_mamba2(tmp_path / "hf")
    path = convert(hf, tmp_path / "mamba2-f32.gguf")
    assert "tokenizer.ggml.merges" not in read_metadata(path)
    with pytest.raises(ConfigError, match=r"'gpt2'.*no merges \(tokenizer\.ggml\.merges\).*--tokenizer"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    write_tokenizer(tokenizer, 256)
    llm = LLM(str(path), tokenizer=str(tokenizer), dtype="float32", device="cpu", max_model_len=64)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def plamo2_metadata(without: tuple[int, ...] = ()) -> dict:
    """A `plamo2` vocabulary: the unknown piece, the byte tokens but `without`, two words."""
    tokens = ["<|plamo:unk|>"] + [f"<0x{b:02X}>" for b in range(256) if b not in without] + ["a", "b"]
    types = [2] + [6] * (256 - len(without)) + [1, 1]
    return {"tokenizer.ggml.model": "plamo2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [0.0] * len(tokens)}


@pytest.mark.parametrize(("metadata", "named"), [
    ({}, r"no tokenizer\.ggml\.model"),
    (plamo2_metadata(without=(0x00, 0x41, 0xFF)), r"'plamo2' vocabulary lacks the byte tokens <0x00>, <0x41>, <0xFF> "),
    (plamo2_metadata(without=tuple(range(20))), r"<0x00>, .*, <0x07> and 12 more"),
    ({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, r"'rwkv' \(tokenizer\.ggml\.model\)"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}, r"tokenizer\.ggml\.scores"),
    ({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}, r"tokenizer\.ggml\.scores"),
], ids=["no_tokenizer", "plamo2_without_three_byte_tokens", "plamo2_without_twenty_byte_tokens", "unknown_model",
        "sentencepiece_without_scores", "unigram_without_scores"])
def test_each_missing_piece_is_named(metadata, named):
    assert re.search(named, tokenizer_problem(metadata) or "")


@pytest.mark.parametrize("metadata", [
    {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]},
    {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.scores": [0.0]},
    # transformers derives Gemma's merges from the tokens' order: no scores needed
    {"general.architecture": "gemma2", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]},
    plamo2_metadata(),
], ids=["bpe_with_merges", "sentencepiece_with_scores", "gemma_without_scores", "plamo2_with_every_byte_token"])
def test_buildable_tokenizers_pass(metadata):
    assert tokenizer_problem(metadata) is None
