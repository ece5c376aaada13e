"""A GGUF file whose tokenizer strata cannot build is refused naming what is missing (the metadata key), before
transformers fails on it with a bare KeyError; a tokenizer passed beside the file still serves it."""
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


@pytest.mark.parametrize(("metadata", "named"), [
    ({}, r"no tokenizer\.ggml\.model"),
    ({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, r"'rwkv' \(tokenizer\.ggml\.model\)"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}, r"tokenizer\.ggml\.scores"),
    ({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}, r"tokenizer\.ggml\.scores"),
], ids=["no_tokenizer", "unknown_model", "sentencepiece_without_scores", "unigram_without_scores"])
def test_each_missing_piece_is_named(metadata, named):
    assert re.search(named, tokenizer_problem(metadata) or "")


@pytest.mark.parametrize("metadata", [
    {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]},
    {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.scores": [0.0]},
    # transformers derives Gemma's merges from the tokens' order: no scores needed
    {"general.architecture": "gemma2", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]},
], ids=["bpe_with_merges", "sentencepiece_with_scores", "gemma_without_scores"])
def test_buildable_tokenizers_pass(metadata):
    assert tokenizer_problem(metadata) is None
