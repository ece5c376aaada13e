"""GGUF files written by llama.cpp's own converter (llama_cpp_gguf.py) from tiny random checkpoints of Granite, Gemma 2,
Gemma 3 (text), Phi-3, Llama, Mistral (written as llama), Qwen2, Qwen3 and Qwen3-MoE: strata's greedy tokens and
logprobs on each file equal transformers' on the checkpoint it came from (a Q8_0 Granite file: on the checkpoint with
its matrices quantized and dequantized by gguf-py). This also checks gguf_variants.py, the test writer that imitates
the converter, against the converter itself; keys the converter does not write are refused by name."""
from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from arch_checkpoints import (
    VOCAB,
    assert_matches_transformers,
    make_arch,
    random_prompts,
    strata_greedy,
    transformers_greedy,
)
from checkpoints import CORPUS, make_llama
from gguf_packing import with_expert_types
from llama_cpp_gguf import convert_many
from safetensors.torch import load_file, save_file

from strata.config import EngineConfig
from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf.config import hf_config
from strata.gguf.reader import GGUFModel

PROMPTS = random_prompts((5, 24), seed=7)  # 24 tokens: past every sliding window below (8 and 16)
MAX_TOKENS = 12
# Each checkpoint as the converter can carry it: what it does not write, the checkpoint leaves at llama.cpp's
# built-in value. Gemma's query_pre_attn_scalar is the head size (llama.cpp scales scores by head_dim ** -0.5);
# Gemma 3 has 6 layers, llama.cpp's period (layers 0-4 slide, layer 5 global, with its own rotary base and linear
# scaling); Mistral and Qwen2 without a sliding window, Qwen3-MoE with every layer sparse (the converter writes
# neither). Qwen2's vocabulary is padded past the tokenizer, as released ones are: transformers' Qwen2 tokenizer
# adds <|endoftext|> as token 320 and the converter wants every token id below vocab_size.
CHECKPOINTS = {
    "granite": lambda f: make_arch(f, "granite", seed=3, num_hidden_layers=2),
    "gemma2": lambda f: make_arch(f, "gemma2", seed=3, num_hidden_layers=2, tied=True, query_pre_attn_scalar=16),
    "gemma3": lambda f: make_arch(f, "gemma3", seed=3, num_hidden_layers=6, tied=True, layer_types=None,
                                  query_pre_attn_scalar=32),
    "phi3": lambda f: make_arch(f, "phi3", seed=3, num_hidden_layers=2),
    "llama": lambda f: make_llama(f, seed=3),
    "mistral": lambda f: make_arch(f, "mistral", seed=3, num_hidden_layers=2, sliding_window=None),
    "qwen2": lambda f: make_arch(f, "qwen2", seed=3, num_hidden_layers=2, use_sliding_window=False,
                                 sliding_window=None, vocab_size=VOCAB + 16),
    "qwen3": lambda f: make_arch(f, "qwen3", seed=3, num_hidden_layers=2),
    "qwen3moe": lambda f: make_arch(f, "qwen3_moe", seed=3, num_hidden_layers=2, mlp_only_layers=[]),
}
# The converter reads Gemma 2's and Phi-3's vocabulary from a SentencePiece model only.
SENTENCEPIECE = ("gemma2", "phi3")
ARCH = {name: "llama" if name == "mistral" else name for name in CHECKPOINTS}  # general.architecture
Q8_0 = gguf.GGMLQuantizationType.Q8_0
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def write_sentencepiece(folder, vocab_size: int = VOCAB) -> None:
    """The checkpoint's BPE tokenizer replaced by a trained SentencePiece model with byte fallback."""
    import sentencepiece

    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, pad_id=-1, unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    for name in ("corpus.txt", "tokenizer.vocab", "tokenizer.json"):
        (folder / name).unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{name: (checkpoint folder, F32 GGUF file)}, plus "granite-q8_0" and "qwen3moe-q8_0" files, converted in one
    converter process."""
    pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("converted")
    folders = {}
    for name, make in CHECKPOINTS.items():
        folders[name] = make(root / name)
        if name in SENTENCEPIECE:
            write_sentencepiece(folders[name])
    jobs = [(folders[name], root / f"{name}.gguf", "f32") for name in CHECKPOINTS]
    jobs += [(folders[name], root / f"{name}-q8_0.gguf", "q8_0") for name in ("granite", "qwen3moe")]
    convert_many(jobs)
    files = {name: (folders[name], root / f"{name}.gguf") for name in CHECKPOINTS}
    files.update({f"{name}-q8_0": (folders[name], root / f"{name}-q8_0.gguf") for name in ("granite", "qwen3moe")})
    return files


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_converted_file_gives_transformers_tokens_of_the_checkpoint(converted, name):
    hf, path = converted[name]
    assert GGUFModel([path]).architecture == ARCH[name]
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS), transformers_greedy(hf, PROMPTS, MAX_TOKENS))


def test_granite_q8_0_file_gives_transformers_tokens_of_the_dequantized_checkpoint(converted, tmp_path):
    """Every matrix is Q8_0 in the file. Its blocks run along rows, so the converter's q/k row permutation does not
    change them: the oracle is the checkpoint with each matrix quantized and dequantized by gguf-py."""
    hf, path = converted["granite-q8_0"]
    reference = tmp_path / "dequantized"
    shutil.copytree(hf, reference)
    state = load_file(str(reference / "model.safetensors"))
    matrices = [name for name, tensor in state.items() if tensor.dim() == 2]
    types = [t.tensor_type for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2]
    assert types == [Q8_0] * len(matrices)
    for name in matrices:
        blocks = gguf.quants.quantize(state[name].numpy(), Q8_0)
        state[name] = torch.from_numpy(gguf.quants.dequantize(blocks, Q8_0).copy())
    save_file(state, str(reference / "model.safetensors"), metadata={"format": "pt"})
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_greedy(reference, PROMPTS, MAX_TOKENS))


def test_routed_experts_of_a_type_strata_does_not_run_are_refused_naming_the_tensor(converted, tmp_path):
    """The converter's Q8_0 experts run in their blocks (tests/gguf/test_qwen3moe_gguf.py); down experts in MXFP4,
    a type strata runs for gpt-oss's experts alone, are refused, not dequantized."""
    EngineConfig.create(str(converted["qwen3moe-q8_0"][1]), dtype="float32", device="cpu")
    path = with_expert_types(converted["qwen3moe"][1], tmp_path / "mxfp4-down.gguf", {"down": MXFP4})
    with pytest.raises(ConfigError, match=r"'blk\.0\.ffn_down_exps\.weight' has type MXFP4"):
        EngineConfig.create(str(path), dtype="float32", device="cpu")


# A key each architecture's converter never writes, and what it would mean.
UNREAD = {"llama": "expert_count",  # Mixtral, which strata's Llama does not run
          "qwen2": "pooling_type",  # an embedding model
          "qwen3": "attention.sliding_window", "qwen3moe": "expert_shared_feed_forward_length",
          "granite": "attention.clamp_kqv", "gemma2": "embedding_scale",
          "gemma3": "attn_logit_softcapping",  # Gemma 2's, which Gemma 3 dropped
          "phi3": "rope.scaling.factor"}


@pytest.mark.parametrize("arch", sorted(UNREAD))
def test_metadata_key_the_converter_does_not_write_is_refused_by_name(converted, arch):
    model = GGUFModel([converted[arch][1]])
    hf_config(model)
    model.metadata[f"{arch}.{UNREAD[arch]}"] = 1
    with pytest.raises(UnsupportedModelError, match=rf"{arch}\.{UNREAD[arch]}"):
        hf_config(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_partial_rotary_or_value_size_unlike_the_head_is_refused(converted, arch):
    """llama.cpp's Llama and Qwen rotate whole heads with keys and values of one size (it asserts so)."""
    for key in ("rope.dimension_count", "attention.value_length"):
        model = GGUFModel([converted[arch][1]])
        model.metadata[f"{arch}.{key}"] = 8
        with pytest.raises(UnsupportedModelError, match=rf"{arch}\.rope\.dimension_count .* differ from the head"):
            hf_config(model)


@pytest.mark.slow
def test_qwen3moe_tp2_pp2_give_the_tokens_of_one_process(converted):
    """Four ranks: heads and each expert's intermediate width split by TP=2 (experts loaded one by one from the
    file's stacked tensors), layers by PP=2."""
    _, path = converted["qwen3moe"]
    one = [o.outputs[0].token_ids for o in strata_greedy(path, PROMPTS, MAX_TOKENS)]
    split = strata_greedy(path, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [o.outputs[0].token_ids for o in split] == one
