"""Mamba2 GGUF files written by llama.cpp's own converter (transformers cannot load them): an F32 file gives the
tokens and logprobs transformers gives the checkpoint it came from; a Q8_0 file (in_proj, out_proj, embedding and
head in blocks, the SSM's own tensors F32) gives transformers' on the checkpoint with those weights replaced by their
dequantized values (gguf-py's dequantizer); metadata strata does not read is refused by name."""
from __future__ import annotations

import shutil

import pytest
import torch
from arch_checkpoints import assert_matches_transformers, random_prompts, strata_greedy, transformers_greedy
from checkpoints import write_tokenizer
from llama_cpp_gguf import convert
from mamba_checkpoints import make_mamba2
from safetensors.torch import load_file, save_file

from strata.errors import UnsupportedModelError
from strata.gguf.config import hf_config
from strata.gguf.reader import GGUFModel

PROMPTS = random_prompts((5, 11, 40), seed=7)  # 40 tokens: several scan chunks
MAX_TOKENS = 16
# The Q8_0 file's tensors in blocks, by the checkpoint's names (the converter's Mamba2 table, written out here).
QUANTIZED = {"token_embd.weight": "backbone.embeddings.weight", "output.weight": "lm_head.weight",
             **{f"blk.{i}.ssm_{p}.weight": f"backbone.layers.{i}.mixer.{p}_proj.weight"
                for i in range(3) for p in ("in", "out")}}


def make_mamba2_checkpoint(folder):
    """Two B/C groups (so the gated norm's [groups, inner / groups] weight is read back in order), and a BPE
    tokenizer with merges (llama.cpp writes the vocabulary GPT-2 style)."""
    path = make_mamba2(folder, vocab_size=320, n_groups=2)
    write_tokenizer(path, 320)
    return path


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    root = tmp_path_factory.mktemp("mamba2_gguf")
    hf = make_mamba2_checkpoint(root / "hf")
    return hf, convert(hf, root / "mamba2-f32.gguf")


def test_f32_file_gives_transformers_tokens_of_the_checkpoint(mamba2):
    hf, path = mamba2
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS), transformers_greedy(hf, PROMPTS, MAX_TOKENS))


def test_q8_0_file_gives_transformers_tokens_of_the_dequantized_weights(mamba2, tmp_path):
    import gguf

    hf, _ = mamba2
    path = convert(hf, tmp_path / "mamba2-q8_0.gguf", "q8_0")
    reader = gguf.GGUFReader(str(path))
    blocked = {t.name: t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0}
    assert blocked.keys() == QUANTIZED.keys()
    reference = tmp_path / "dequantized"
    shutil.copytree(hf, reference)
    state = load_file(str(reference / "model.safetensors"))
    for name, tensor in blocked.items():
        state[QUANTIZED[name]] = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    save_file(state, str(reference / "model.safetensors"), metadata={"format": "pt"})
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_greedy(reference, PROMPTS, MAX_TOKENS))


def test_metadata_strata_does_not_read_is_refused_by_name(mamba2):
    gguf = GGUFModel([mamba2[1]])
    config = hf_config(gguf)
    assert (config["num_heads"], config["head_dim"], config["n_groups"], config["expand"]) == (8, 16, 2, 2)
    gguf.metadata["mamba2.ssm.dt_b_c_rms"] = True
    with pytest.raises(UnsupportedModelError, match=r"mamba2\.ssm\.dt_b_c_rms"):
        hf_config(gguf)


@pytest.mark.slow
def test_tp2_pp2_give_the_tokens_of_one_process(mamba2):
    """Four ranks: Mamba heads and B/C groups split by TP=2, layers by PP=2."""
    path = mamba2[1]
    one = [o.outputs[0].token_ids for o in strata_greedy(path, PROMPTS, MAX_TOKENS)]
    split = strata_greedy(path, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [o.outputs[0].token_ids for o in split] == one
