"""Tiny GGUF files written as llama.cpp's converter writes them (metadata, a GPT-2 style tokenizer, q/k rows permuted
for the llama architecture), from a random Hugging Face checkpoint, with tensors in any ggml type (`gguf_packing`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf_packing import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, quantize  # noqa: F401

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, index, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{_LAYER[module]}.{kind}"


def types_by_prefix(table: dict[str, int], default: int = Q8_0):
    """`write_gguf`'s `type_of`: the type of the first prefix of `table` a tensor's name starts with, else default."""
    return lambda name, shape: next((t for prefix, t in table.items() if name.startswith(prefix + ".")), default)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: rotate-half rows of each head reordered into interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_folder: Path, path: Path, type_of, arch: str = "llama", split: int = 1,
               spm_model: Path | None = None, pre: str = "default") -> list[Path]:
    """The checkpoint in `hf_folder` as a GGUF file (or `split` parts); `type_of(gguf_name, shape)` picks each
    matrix's ggml type (vectors stay F32). With `spm_model`, a SentencePiece model file, the vocabulary is that
    model's pieces with their scores and kinds, as llama.cpp's converter writes a Llama 2 style tokenizer; else the
    checkpoint's byte-level BPE, with `pre` as its `tokenizer.ggml.pre` (how llama.cpp splits text before merging)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    tok_config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    state = {}
    for f in sorted(hf_folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    tensors = []
    for name, value in state.items():
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        w = value.to(torch.float32).numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, heads if "q_proj" in name else kv_heads)
        target = gguf_name(name)
        kind = type_of(target, w.shape) if w.ndim == 2 else F32
        tensors.append((target, w.astype(np.float32) if w.ndim == 1 else quantize(w, kind), kind))
    paths = [path] if split == 1 else [path.with_name(f"{path.stem}-{i + 1:05d}-of-{split:05d}.gguf")
                                       for i in range(split)]
    per_part = -(-len(tensors) // split)
    for part, out in enumerate(paths):
        writer = gguf.GGUFWriter(str(out), arch)
        if part == 0:
            _metadata(writer, config, tok, tok_config, arch, spm_model, pre)
        if split > 1:
            writer.add_uint16("split.no", part)
            writer.add_uint16("split.count", split)
            writer.add_int32("split.tensors.count", len(tensors))
        if part == 0 and _rope(config).get("rope_type") == "llama3":
            writer.add_tensor("rope_freqs.weight", _llama3_freq_factors(config))
        for target, data, kind in tensors[part * per_part:(part + 1) * per_part]:
            writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType(kind))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return paths


def _rope(config: dict) -> dict:
    return config.get("rope_scaling") or config.get("rope_parameters") or {}


def _llama3_freq_factors(config: dict) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3.1's rotary scaling: a divisor per rotary frequency."""
    scaling, heads = _rope(config), config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    theta = config.get("rope_theta", scaling.get("rope_theta", 10000.0))
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _spm_vocabulary(writer, spm_model: Path) -> None:
    """A SentencePiece model's pieces, scores and kinds (ggml: 1 normal, 2 unknown, 3 control, 6 byte)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    ids = range(sp.get_piece_size())
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in ids]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in ids])
    writer.add_token_scores([sp.get_score(i) for i in ids])
    writer.add_token_types(kinds)
    writer.add_unk_token_id(sp.unk_id())


def _metadata(writer, config: dict, tok: dict, tok_config: dict, arch: str, spm_model: Path | None = None,
              pre: str = "default") -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta")))
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads or arch != "llama":  # llama.cpp's converter writes it for qwen3
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if spm_model is not None:
        _spm_vocabulary(writer, spm_model)
    else:
        vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
        added = {t["id"]: t["content"] for t in tok["added_tokens"]}
        tokens = [added.get(i, piece) for piece, i in vocab]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
        merges = tok["model"]["merges"]
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config.get("bos_token_id", 0))
    writer.add_eos_token_id(config.get("eos_token_id", 1))
    writer.add_add_bos_token(True)
    writer.add_chat_template(tok_config["chat_template"])
