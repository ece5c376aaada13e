"""Tiny GGUF files of Gemma 2, Gemma 3, Phi-3 and Granite written from a random transformers checkpoint the way
llama.cpp's convert_hf_to_gguf.py writes them (conversion/gemma.py, phi.py, granite.py): its metadata keys for each,
Gemma's norms stored as 1 + w and no output head, Phi-3's fused attn_qkv / ffn_up (gate and up) and LongRoPE factor
tensors, Granite's q/k rows permuted as Llama's; matrices in any ggml type (`gguf_packing`), vectors F32."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf_checkpoints import _permute
from gguf_packing import F32, quantize

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Where Gemma's names part from Llama's (gguf-py's tensor_mapping).
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, index, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**_LAYER, **(_GEMMA_LAYER if arch.startswith("gemma") else {"post_attention_layernorm": "ffn_norm"})}
    return f"blk.{index}.{names[module]}.{kind}"


def write_variant_gguf(hf_folder: Path, path: Path, arch: str, type_of, extra: dict[str, float] | None = None,
                       vocabulary=None) -> Path:
    """The checkpoint in `hf_folder` as a GGUF file of `arch` (gemma2, gemma3, phi3, granite); `type_of(gguf_name,
    shape)` picks each matrix's ggml type; `extra`: more float32 metadata keys; `vocabulary(writer)` writes the
    tokenizer's keys (default: the checkpoint's byte-level BPE tokenizer)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    state = {}
    for f in sorted(hf_folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    _METADATA[arch](writer, config)
    if vocabulary is not None:
        vocabulary(writer)
    else:
        _vocabulary(writer, hf_folder, config)
    for key, value in (extra or {}).items():
        writer.add_float32(key, value)
    if arch == "phi3":
        for name, factors in _longrope_factors(config):
            writer.add_tensor(name, factors)
    for name, value in state.items():
        if name == "lm_head.weight" and (arch.startswith("gemma") or config.get("tie_word_embeddings")):
            continue  # Gemma's converter drops the head (tied)
        w = value.to(torch.float32)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        w = w.numpy()
        if arch == "granite" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, heads if "q_proj" in name else kv_heads)
        target = gguf_name(name, arch)
        kind = type_of(target, w.shape) if w.ndim == 2 else F32
        data = w.astype(np.float32) if w.ndim == 1 else quantize(w, kind)
        writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _shapes(writer, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def _gemma2(writer, config: dict) -> None:  # Gemma2Model.set_gguf_parameters: no rotary base (llama.cpp's 10000)
    _shapes(writer, config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(1)
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _gemma3(writer, config: dict) -> None:  # TextModel's keys, then Gemma3Model's
    _shapes(writer, config)
    rope = config["rope_parameters"]
    full, local = rope["full_attention"], rope["sliding_attention"]
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf_rope_type("LINEAR"))
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_freq_base_swa(local["rope_theta"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(1)
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _phi3(writer, config: dict) -> None:  # Phi3MiniModel.set_gguf_parameters
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    heads = config["num_attention_heads"]
    rotary = int(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
                 * config["hidden_size"]) // heads
    _shapes(writer, config)
    writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_file_type(1)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = config["max_position_embeddings"] / config["original_max_position_embeddings"]
        original = config["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1)


def _longrope_factors(config: dict):
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("long_factor"):
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def _granite(writer, config: dict) -> None:  # TextModel's keys, LlamaModel's, then GraniteModel's multipliers
    _shapes(writer, config)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_file_type(1)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_attention_scale(config["attention_multiplier"])
    writer.add_embedding_scale(config["embedding_multiplier"])
    writer.add_residual_scale(config["residual_multiplier"])
    writer.add_logit_scale(config["logits_scaling"])


_METADATA = {"gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "granite": _granite}


def gguf_rope_type(name: str):
    import gguf

    return getattr(gguf.RopeScalingType, name)


def _vocabulary(writer, hf_folder: Path, config: dict) -> None:
    """The checkpoint's byte-level BPE tokenizer as `_set_vocab_gpt2` writes it."""
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    tok_config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [added.get(i, piece) for piece, i in vocab]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(tok_config["chat_template"])
