"""Gemma 2, Gemma 3, Phi-3 and Granite GGUF files (written as llama.cpp's converter writes them, gguf_variants.py)
against transformers: logits and greedy tokens; the config strata reads from the metadata; unknown metadata keys
refused by name; TP=2 x PP=2 gives one process's tokens.

Oracles: Gemma 2, Gemma 3 and Phi-3 load the GGUF file itself into transformers (`gguf_file=`, dequantized, into the
source checkpoint's config). transformers cannot load Granite GGUF files: its oracle is the source checkpoint with
every matrix replaced by what the file's blocks hold (quantized and dequantized by the gguf package)."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from arch_checkpoints import make_arch, random_prompts
from gguf_checkpoints import Q4_1, Q5_0, Q8_0, types_by_prefix
from gguf_variants import write_variant_gguf
from model_forward import strata_logits
from transformers import AutoConfig, AutoModelForCausalLM

from strata import LLM, SamplingParams
from strata.errors import UnsupportedModelError
from strata.gguf.config import hf_config
from strata.gguf.reader import GGUFModel

# Each family as its converter can express it: Gemma tied, with query_pre_attn_scalar = head_dim (llama.cpp's scale),
# Gemma 3's sliding layers in llama.cpp's period of 6 (7 layers: the 6th global), with its own rotary bases and linear
# scaling on the global layers; Phi-3 with half-rotating heads and LongRoPE; Granite with its four multipliers.
FAMILIES = {"gemma2": dict(query_pre_attn_scalar=16, tied=True), "phi3": {}, "granite": {},
            "gemma3": dict(query_pre_attn_scalar=32, num_hidden_layers=7, layer_types=None, tied=True)}
TYPES = types_by_prefix({"blk.1": Q4_1, "blk.2": Q5_0}, Q8_0)
TOKENS = 12


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, source checkpoint folder, GGUF path)."""
    name, folder = request.param, tmp_path_factory.mktemp(request.param)
    hf = make_arch(folder / "hf", name, seed=3, **FAMILIES[name])
    return name, hf, write_variant_gguf(hf, folder / f"{name}.gguf", name, TYPES)


def _dequantized_checkpoint(hf, path, out):
    """The source checkpoint with each matrix as the GGUF file stores it (Granite's q/k rows permuted back)."""
    from safetensors.torch import load_file, save_file

    from strata.gguf.weights import _unpermute

    out.mkdir()
    config = json.loads((hf / "config.json").read_text())
    state = load_file(str(hf / "model.safetensors"))
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    from gguf_variants import gguf_name
    for name in state:
        values = stored[gguf_name(name, "granite")].reshape(state[name].shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            values = _unpermute(values, heads)
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32))
    save_file(state, str(out / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / f).write_text((hf / f).read_text())
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)


def _reference(name, hf, path, tmp_path):
    if name == "granite":
        return _dequantized_checkpoint(hf, path, tmp_path / "dequantized")
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                config=AutoConfig.from_pretrained(hf))


def test_logits_and_greedy_tokens_match_transformers(family, tmp_path):
    name, hf, path = family
    reference = _reference(name, hf, path, tmp_path).eval()
    prompts = random_prompts((24, 5, 17), seed=4)
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[0]])).logits[0]
    got = strata_logits(path, prompts[0], max_model_len=64)  # Phi-3: within LongRoPE's original length (short)
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()

    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        sequence = list(prompt)
        with torch.no_grad():
            for _ in range(TOKENS):
                sequence.append(int(reference(torch.tensor([sequence])).logits[0, -1].argmax()))
            logprobs = reference(torch.tensor([sequence[:-1]])).logits[0, len(prompt) - 1:].log_softmax(-1)
        tokens = out.outputs[0].token_ids
        assert tokens == sequence[len(prompt):]
        for i, (token, lp) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[token].logprob - logprobs[i, token].item()) < 1e-4


def test_config_from_metadata_is_the_checkpoints(family):
    """What each model reads of its config.json comes back from the metadata as the source checkpoint had it."""
    name, hf, path = family
    got, source = hf_config(GGUFModel([path])), json.loads((hf / "config.json").read_text())
    keys = {"gemma2": ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "layer_types",
                       "query_pre_attn_scalar", "head_dim"),
            "gemma3": ("sliding_window", "layer_types", "query_pre_attn_scalar", "head_dim", "rope_parameters"),
            "phi3": ("original_max_position_embeddings",),
            "granite": ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling")}
    for key in keys[name]:
        want = source[key]
        assert got[key] == (pytest.approx(want) if isinstance(want, float) else want), key  # floats stored as f32
    if name == "phi3":
        rope = source["rope_parameters"]
        assert got["partial_rotary_factor"] == rope["partial_rotary_factor"]
        assert got["rope_scaling"]["short_factor"] == pytest.approx(rope["short_factor"])
        assert got["rope_scaling"]["long_factor"] == pytest.approx(rope["long_factor"])


def test_unknown_metadata_key_is_refused_by_name(family, tmp_path):
    name, hf, _ = family
    path = write_variant_gguf(hf, tmp_path / "extra.gguf", name, TYPES, extra={f"{name}.attention.clamp_kqv": 8.0})
    with pytest.raises(UnsupportedModelError, match=f"{name}.attention.clamp_kqv"):
        hf_config(GGUFModel([path]))


@pytest.mark.slow
def test_tp2_pp2_gives_the_tokens_of_one_process(family):
    _, _, path = family
    prompts = [{"prompt_token_ids": p} for p in random_prompts((20, 9), seed=5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), device="cpu", max_model_len=64) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(path), device="cpu", max_model_len=64, tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
