"""Llama 4 text GGUF files written by llama.cpp's own converter. The file carries neither the attention chunk size
nor the temperature tuning's floor: llama.cpp builds in Llama 4's 8192 for both, so the oracle is transformers on
the checkpoint with those two set to 8192 (the test checkpoint's own are 8 and 4). An F32 file gives its tokens and
logprobs; an F16 file (matrices in F16 blocks, routed experts F16 loaded as float) gives transformers' on the
checkpoint with every F16 tensor replaced by gguf-py's values; the converter's Q8_0 file (routed experts in Q8_0
blocks, kept in them) gives transformers' tokens of the checkpoint with every Q8_0 tensor replaced by gguf-py's
dequantized values. Experts in a type strata does not run are refused naming the tensor and its type; so is
metadata strata does not read."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from arch_checkpoints import assert_matches_transformers, random_prompts, strata_greedy, transformers_greedy
from gguf_packing import with_expert_types
from llama4_checkpoints import TEXT_CONFIG, make_llama4_text
from llama_cpp_gguf import convert
from safetensors.torch import load_file, save_file

from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf.config import hf_config
from strata.gguf.reader import GGUFModel

PROMPTS = random_prompts((5, 11, 40), seed=7)
MXFP4 = 39  # ggml's type number: strata runs it for gpt-oss's experts alone
MAX_TOKENS = 12
LLAMA_CPP_CHUNK = LLAMA_CPP_FLOOR = 8192  # llama_model_llama4::load_arch_hparams
# GGUF layer tensor -> the checkpoint's (the converter's Llama 4 table, written out here); experts apart.
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "feed_forward.gate_proj",
               "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj",
               "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
               "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
               "ffn_down_shexp": "feed_forward.shared_expert.down_proj"}


def as_llama_cpp_runs_it(hf, folder):
    """A copy of the checkpoint whose config says what llama.cpp assumes of every Llama 4 file."""
    shutil.copytree(hf, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(attention_chunk_size=LLAMA_CPP_CHUNK, floor_scale=LLAMA_CPP_FLOOR)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """(the checkpoint as llama.cpp runs it, its F32 GGUF file)."""
    root = tmp_path_factory.mktemp("llama4_gguf")
    hf = make_llama4_text(root / "hf")
    return as_llama_cpp_runs_it(hf, root / "reference"), convert(hf, root / "llama4-f32.gguf")


def test_f32_file_gives_transformers_tokens_of_the_checkpoint(llama4):
    reference, path = llama4
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_greedy(reference, PROMPTS, MAX_TOKENS))


def checkpoint_values(state: dict, name: str, values: torch.Tensor) -> None:
    """Put a GGUF tensor's values where the checkpoint holds them."""
    _, layer, kind, _ = name.split(".")
    prefix = f"model.layers.{layer}.feed_forward.experts."
    if kind in ("ffn_gate_exps", "ffn_up_exps"):  # gate_up [E, H, 2I]: gate columns, then up
        half = TEXT_CONFIG["intermediate_size"]
        columns = slice(0, half) if kind == "ffn_gate_exps" else slice(half, 2 * half)
        state[prefix + "gate_up_proj"][:, :, columns] = values.transpose(1, 2)
    elif kind == "ffn_down_exps":
        state[prefix + "down_proj"] = values.transpose(1, 2).contiguous()
    else:
        state[f"model.layers.{layer}.{LAYER_NAMES[kind]}.weight"] = values


def write_dequantized(state: dict, blocked: list, folder) -> None:
    """The checkpoint's tensors replaced by the file's (F16 or Q8_0 blocks, as gguf-py reads them), saved in
    `folder`."""
    import gguf

    for tensor in blocked:
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        if tensor.name in ("token_embd.weight", "output.weight"):
            state["model.embed_tokens.weight" if tensor.name == "token_embd.weight" else "lm_head.weight"] = values
        else:
            checkpoint_values(state, tensor.name, values)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_f16_file_gives_transformers_tokens_of_its_f16_weights(llama4, tmp_path):
    """Experts F16 in the file, float in strata; every other matrix in F16 blocks."""
    import gguf

    reference, _ = llama4
    path = convert(reference, tmp_path / "llama4-f16.gguf", "f16")
    rounded = as_llama_cpp_runs_it(reference, tmp_path / "rounded")
    state = load_file(str(rounded / "model.safetensors"))
    halves = [t for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type == gguf.GGMLQuantizationType.F16]
    assert any("_exps" in t.name for t in halves)
    write_dequantized(state, halves, rounded)
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_greedy(rounded, PROMPTS, MAX_TOKENS))


def requantize_all_but_experts(source, out):
    """`source` (an F32 file) with every matrix but the routed experts and the router in Q8_0 by gguf-py's
    quantizer, as `llama-quantize --tensor-type ffn_.*_exps=f32 ... q8_0` writes it; metadata copied as it is."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), "llama4")
    kept = {t.name for t in reader.tensors if t.data.ndim < 2 or "_exps" in t.name or "ffn_gate_inp" in t.name}
    for i, tensor in enumerate(reader.tensors):
        if tensor.name not in kept:
            data = gguf.quants.quantize(tensor.data, gguf.GGMLQuantizationType.Q8_0)
            reader.tensors[i] = tensor._replace(data=data, tensor_type=gguf.GGMLQuantizationType.Q8_0,
                                                n_bytes=data.nbytes)
    copy_with_new_metadata(reader, writer, {}, ())
    return out


def test_q8_0_matrices_with_float_experts_give_transformers_tokens_of_the_dequantized_weights(llama4, tmp_path):
    import gguf

    reference, source = llama4
    path = requantize_all_but_experts(source, tmp_path / "llama4-q8_0-f32-experts.gguf")
    dequantized = as_llama_cpp_runs_it(reference, tmp_path / "dequantized")
    state = load_file(str(dequantized / "model.safetensors"))
    blocked = [t for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    assert len(blocked) == 2 + 4 * 4 + 2 * 3 + 2 * 3  # embedding, head; attention; dense MLPs; shared experts
    write_dequantized(state, blocked, dequantized)
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_greedy(dequantized, PROMPTS, MAX_TOKENS))


def test_q8_0_file_gives_transformers_tokens_of_its_dequantized_weights(llama4, tmp_path):
    """The converter's Q8_0 file: every matrix, the routed experts too, in Q8_0 blocks (the router stays F32)."""
    import gguf

    reference, _ = llama4
    path = convert(reference, tmp_path / "llama4-q8_0.gguf", "q8_0")
    dequantized = as_llama_cpp_runs_it(reference, tmp_path / "dequantized")
    state = load_file(str(dequantized / "model.safetensors"))
    blocked = [t for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    assert {t.name for t in blocked if "_exps" in t.name} == {f"blk.{n}.ffn_{p}_exps.weight" for n in (1, 3)
                                                               for p in ("gate", "up", "down")}
    write_dequantized(state, blocked, dequantized)
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_greedy(dequantized, PROMPTS, MAX_TOKENS))


def test_experts_of_a_type_strata_does_not_run_are_refused_naming_the_tensor_and_its_type(llama4, tmp_path):
    from strata import LLM

    path = with_expert_types(llama4[1], tmp_path / "llama4-mxfp4-down.gguf", {"down": MXFP4})
    with pytest.raises(ConfigError, match=r"'blk\.1\.ffn_down_exps\.weight' has type MXFP4"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=64)


def test_metadata_strata_does_not_read_is_refused_by_name(llama4):
    gguf = GGUFModel([llama4[1]])
    config = hf_config(gguf)
    assert (config["intermediate_size"], config["intermediate_size_mlp"], config["interleave_moe_layer_step"]) == (
        TEXT_CONFIG["intermediate_size"], TEXT_CONFIG["intermediate_size_mlp"], 2)
    gguf.metadata["llama4.attention.sliding_window"] = 0
    with pytest.raises(UnsupportedModelError, match=r"llama4\.attention\.sliding_window"):
        hf_config(gguf)


@pytest.mark.slow
def test_tp2_pp2_give_the_tokens_of_one_process(llama4):
    """Four ranks: heads, the dense MLPs, the shared expert and each routed expert's width split by TP=2, the layers
    (one dense, one MoE on each stage) by PP=2."""
    path = llama4[1]
    one = [o.outputs[0].token_ids for o in strata_greedy(path, PROMPTS, MAX_TOKENS)]
    split = strata_greedy(path, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [o.outputs[0].token_ids for o in split] == one
