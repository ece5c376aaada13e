"""Llama 4 text GGUF files as llama.cpp's converter writes them (`general.architecture` llama4): the config.json of
the Llama4ForCausalLM checkpoint they came from, and their tensors under its names. The routed experts come as gate,
up and down tensors [E, out, in]: float ones rebuilt into the checkpoint's fused [E, H, 2I] gate_up and [E, I, H]
down, quantized ones kept in their ggml blocks, one tensor per expert (strata/layers/quantization/gguf_experts.py runs
them). The file carries neither the attention chunk size, the NoPE layer interval nor the temperature tuning:
llama.cpp builds in Llama 4's (8192, every 4th layer, floor 8192 and scale 0.1) and so does this module; llama3
rotary scaling comes as rope_freqs."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from strata.errors import UnsupportedModelError
from strata.gguf import types
from strata.gguf.config import _eos_ids, _per_layer, _required, _rope_scaling
from strata.gguf.families import refuse_unknown_keys, refuse_unknown_tensors
from strata.gguf.reader import GGUFModel
from strata.gguf.ssm import _float
from strata.gguf.weights import GGUFTensor, _meta, _tensor, expert_blocks, experts_in_blocks, is_blocked

# The llama4.* keys the converter writes and this module reads; any other (a sliding window, its pattern, a second
# rotary base) is refused by name.
KNOWN_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon", "expert_count",
              "expert_used_count", "attention.key_length", "attention.value_length", "vocab_size",
              "rope.dimension_count", "interleave_moe_layer_step", "expert_feed_forward_length",
              "rope.scaling.type", "rope.scaling.factor")
# What llama.cpp's Llama 4 has built in (llama_model_llama4::load_arch_hparams), the file not carrying it.
ATTENTION_CHUNK, NO_ROPE_INTERVAL, FLOOR_SCALE, ATTN_SCALE = 8192, 4, 8192, 0.1
QK_NORM_OFF_EXPERTS = 128  # Maverick (128 experts) has no q/k norm; llama.cpp tells it by its expert count

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj",
          "ffn_gate_inp": "feed_forward.router", "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
          "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
          "ffn_down_shexp": "feed_forward.shared_expert.down_proj"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_CONSUMED = ("rope_freqs.weight",)  # read into the config


def hf_config(gguf: GGUFModel) -> dict[str, Any]:
    """The config.json of the Llama 4 text checkpoint the file holds."""
    refuse_unknown_keys(gguf, KNOWN_KEYS)
    heads = _per_layer(gguf, ".attention.head_count", _required(gguf, ".attention.head_count"))
    hidden = _required(gguf, ".embedding_length")
    head_dim = gguf.get(".attention.key_length", hidden // heads)
    for key in (".attention.value_length", ".rope.dimension_count"):
        if gguf.get(key, head_dim) != head_dim:
            raise UnsupportedModelError(f"{gguf.paths[0]}: llama4{key}={gguf.get(key)} differs from the head size "
                                        f"{head_dim} (llama.cpp's Llama 4 requires them equal)", param="model")
    experts = _required(gguf, ".expert_count")
    expert_ff = gguf.get(".expert_feed_forward_length")
    return {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "torch_dtype": "float32",
        "vocab_size": gguf.get(".vocab_size") or gguf.tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "num_hidden_layers": _required(gguf, ".block_count"), "num_attention_heads": heads,
        "num_key_value_heads": _per_layer(gguf, ".attention.head_count_kv", gguf.get(".attention.head_count_kv",
                                                                                        heads)),
        "head_dim": head_dim, "intermediate_size": _per_layer(gguf, ".expert_feed_forward_length", expert_ff),
        "intermediate_size_mlp": _required(gguf, ".feed_forward_length"), "num_local_experts": experts,
        "num_experts_per_tok": _required(gguf, ".expert_used_count"),
        "interleave_moe_layer_step": _required(gguf, ".interleave_moe_layer_step"),
        "no_rope_layer_interval": NO_ROPE_INTERVAL, "attention_chunk_size": ATTENTION_CHUNK,
        "use_qk_norm": experts != QK_NORM_OFF_EXPERTS, "attn_temperature_tuning": True,
        "floor_scale": FLOOR_SCALE, "attn_scale": ATTN_SCALE,
        "rms_norm_eps": _required(gguf, ".attention.layer_norm_rms_epsilon"),
        "rope_theta": gguf.get(".rope.freq_base", 10000.0), "rope_scaling": _rope_scaling(gguf, head_dim),
        "max_position_embeddings": gguf.get(".context_length", 8192),
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"), "eos_token_id": _eos_ids(gguf),
    }


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint name of a tensor other than the routed experts', or None for one strata does not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _LAYER:
        return None
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER[kind]}.{suffix}"


def blocked_types(gguf: GGUFModel) -> dict[str, int]:
    """{checkpoint name: ggml type} of the tensors kept in blocks: every matrix, and the routed experts of a layer
    whose experts the file quantized (`...feed_forward.experts.gate_proj.weight` etc.); any other type is refused
    naming the tensor."""
    refuse_unknown_tensors(gguf, [n for n in gguf.tensors
                                  if hf_name(n) is None and not _EXPERTS.match(n) and n not in _CONSUMED])
    found = {}
    for name, entry in gguf.tensors.items():
        match = _EXPERTS.match(name)
        if match is not None:
            types.check_type(entry.ggml_type, name)
            if experts_in_blocks(gguf, name):
                layer, proj = match.groups()
                found[f"model.layers.{layer}.feed_forward.experts.{proj}_proj.weight"] = entry.ggml_type
            continue
        if name in _CONSUMED:
            continue
        types.check_type(entry.ggml_type, name)
        if is_blocked(entry):
            found[hf_name(name)] = entry.ggml_type
    return found


def iterate(gguf: GGUFModel, skip: Callable[[str], bool] = lambda name: False, meta: bool = False
            ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(checkpoint name, tensor) for every tensor; the routed experts as transformers' fused float tensors, or one
    tensor in ggml blocks per expert and projection when the file quantized them."""
    for name, entry in gguf.tensors.items():
        if name in _CONSUMED:
            continue
        match = _EXPERTS.match(name)
        if match is not None and experts_in_blocks(gguf, name):
            layer, proj = match.groups()
            names = [f"model.layers.{layer}.feed_forward.experts.{e}.{proj}_proj.weight" for e in range(entry.shape[0])]
            for e, target in enumerate(names):
                if not skip(target):
                    yield target, expert_blocks(gguf, entry, e, meta)
            continue
        if match is not None:
            layer, proj = match.groups()
            target = f"model.layers.{layer}.feed_forward.experts.{'down' if proj == 'down' else 'gate_up'}_proj"
            if proj != "up" and not skip(target):
                yield target, _experts(gguf, f"blk.{layer}.ffn_", proj, meta)
            continue
        target = hf_name(name)
        if not skip(target):
            yield target, _meta(entry) if meta else _tensor(entry, gguf.raw(name))


def _experts(gguf: GGUFModel, blk: str, proj: str, meta: bool) -> torch.Tensor:
    """Used as x @ W: gate_up [E, H, 2I] (gate columns, then up), down [E, I, H]; the file's are [E, out, in]."""
    names = [f"{blk}{p}_exps.weight" for p in (("gate", "up") if proj == "gate" else ("down",))]
    entries = [gguf.tensors[n] for n in names]
    if meta:
        experts, rows, cols = entries[0].shape
        return torch.empty(experts, cols, rows * len(entries), device="meta")
    return torch.cat([_float(gguf, e).transpose(1, 2) for e in entries], dim=-1).contiguous()
