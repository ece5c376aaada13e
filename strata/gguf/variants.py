"""GGUF files of Llama's close variants Gemma 2, Gemma 3 (text), Phi-3 and Granite: what llama.cpp's converter writes
for each beyond Llama's keys and tensor names, turned back into the config.json keys strata's models read, and the
metadata keys each may carry, Llama's and Qwen's included (strata.gguf.families refuses any other by name)."""
from __future__ import annotations

from typing import Any

from strata.errors import UnsupportedModelError
from strata.gguf.reader import GGUFModel

# Keys the shared part of strata.gguf.config reads.
_SHAPES = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size", "attention.head_count",
    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
    "attention.value_length", "rope.dimension_count", "rope.freq_base"})
_LINEAR_ROPE = frozenset({"rope.scaling.type", "rope.scaling.factor"})
GEMMA2_KEYS = _SHAPES | {"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window",
                         "attention.sliding_window_pattern", "rope.freq_base_swa"}
GEMMA3_KEYS = _SHAPES | _LINEAR_ROPE | {"final_logit_softcapping", "attention.sliding_window",
                                       "attention.sliding_window_pattern", "rope.freq_base_swa"}
PHI3_KEYS = _SHAPES | {"attention.sliding_window", "rope.scaling.original_context_length",
                       "rope.scaling.attn_factor"}
GRANITE_KEYS = _SHAPES | _LINEAR_ROPE | {"attention.scale", "embedding_scale", "residual_scale", "logit_scale",
                                        "rope.scaling.finetuned"}
# Llama itself (Mistral's checkpoints too: current converters write them as llama), Qwen2, Qwen3 and Qwen3-MoE, as
# the converter writes them. Refused by name: a sliding window or pooling type, Mixtral's experts in a llama file,
# YaRN's parameters. tensor_data_layout is the old convert.py's note on its source, which llama.cpp never reads.
LLAMA_KEYS = _SHAPES | _LINEAR_ROPE | {"tensor_data_layout"}
QWEN_KEYS = _SHAPES | _LINEAR_ROPE
QWEN3MOE_KEYS = QWEN_KEYS | {"expert_count", "expert_used_count", "expert_feed_forward_length"}

# GGUF layer tensor names whose meaning differs from Llama's (strata.gguf.weights._LAYER_NAMES).
GEMMA_TENSORS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
PHI3_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # stored fused, as in the checkpoint
PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _refuse(gguf: GGUFModel, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{gguf.paths[0]}: {why}", param="model")


def _full_rotary(gguf: GGUFModel, config: dict[str, Any]) -> None:
    """Gemma and Granite rotate whole heads, with keys and values of one head size."""
    dims = gguf.get(".rope.dimension_count", config["head_dim"])
    values = gguf.get(".attention.value_length", config["head_dim"])
    if dims != config["head_dim"] or values != config["head_dim"]:
        raise _refuse(gguf, f"{gguf.architecture}.rope.dimension_count {dims} / attention.value_length {values} "
                            f"differ from the head size {config['head_dim']}, which strata's "
                            f"{gguf.architecture} model does not support")


def _layer_types(gguf: GGUFModel, layers: int, every: int) -> list[str]:
    """llama.cpp's sliding layers: a per-layer list of flags, or a period (the last layer of each `every` global;
    0: all sliding), as `attention.sliding_window_pattern` gives it, else the architecture's default period."""
    pattern = gguf.get(".attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise _refuse(gguf, f"{gguf.architecture}.attention.sliding_window_pattern has {len(pattern)} flags "
                                f"for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma(gguf: GGUFModel, config: dict[str, Any], every: int, default_window: int | None) -> dict[str, Any]:
    _full_rotary(gguf, config)
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    window = gguf.get(".attention.sliding_window", default_window)
    # llama.cpp scales scores by head_dim ** -0.5, except the 27B models' by (hidden / heads) ** -0.5 (what their
    # checkpoints set as query_pre_attn_scalar); the file says neither, llama.cpp tells the 27B by its layer count.
    big = {"gemma2": 46, "gemma3": 62}[gguf.architecture] == layers
    extra = {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
             "query_pre_attn_scalar": config["hidden_size"] // heads if big else config["head_dim"],
             "sliding_window": window or None,
             "layer_types": _layer_types(gguf, layers, every) if window else ["full_attention"] * layers}
    # Absent caps keep each generation's default (Gemma 2: 50 and 30, as llama.cpp's; Gemma 3: none).
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if gguf.get("." + key) is not None:
            extra[key] = float(gguf.get("." + key))
    return extra


def gemma2_config(gguf: GGUFModel, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2: every other layer sliding (4096 tokens unless the file says), both soft caps, one rotary base."""
    if config["rope_scaling"] is not None:
        raise _refuse(gguf, "rotary scaling in a gemma2 file is not supported")
    if gguf.get(".rope.freq_base_swa", config["rope_theta"]) != config["rope_theta"]:
        raise _refuse(gguf, "gemma2.rope.freq_base_swa differs from rope.freq_base: strata's Gemma 2 rotates every "
                            "layer with one base")
    return _gemma(gguf, config, every=2, default_window=4096)


def gemma3_config(gguf: GGUFModel, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3: five sliding layers to one global, rotary base 10000 on sliding layers unless the file says
    (rope.freq_base_swa), the global layers' linear scaling (4B and larger) from rope.scaling."""
    extra = _gemma(gguf, config, every=6, default_window=None)
    full = {"rope_type": "default", **(config["rope_scaling"] or {}), "rope_theta": config["rope_theta"]}
    local = {"rope_type": "default", "rope_theta": gguf.get(".rope.freq_base_swa", 10000.0)}
    extra["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    extra["rope_scaling"] = None  # given per layer type above
    return extra


def phi3_config(gguf: GGUFModel, config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3: the rotating share of each head from rope.dimension_count; LongRoPE from the long/short factor tensors
    (with the file's attention factor); a sliding window when the file sets one above 0 (0: Phi-4-mini's none)."""
    head_dim, rotary = config["head_dim"], gguf.get(".rope.dimension_count", config["head_dim"])
    original = gguf.get(".rope.scaling.original_context_length", config["max_position_embeddings"])
    extra: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim, "original_max_position_embeddings": original,
                             "sliding_window": gguf.get(".attention.sliding_window") or None, "hidden_act": "silu"}
    present = [name for name in PHI3_ROPE_FACTORS if name in gguf.tensors]
    if len(present) == 1:
        raise _refuse(gguf, f"the file has {present[0]} without its pair; LongRoPE needs both")
    if present:
        long, short = (gguf.raw(name).view("<f4").tolist() for name in PHI3_ROPE_FACTORS)
        extra["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                                 "original_max_position_embeddings": original,
                                 "factor": config["max_position_embeddings"] / original}
        if gguf.get(".rope.scaling.attn_factor") is not None:
            extra["rope_scaling"]["attention_factor"] = float(gguf.get(".rope.scaling.attn_factor"))
    elif config["rope_scaling"] is not None or gguf.get(".rope.scaling.attn_factor") is not None:
        raise _refuse(gguf, "rotary scaling in a phi3 file without LongRoPE factor tensors is not supported")
    return extra


def llama_config(gguf: GGUFModel, config: dict[str, Any]) -> dict[str, Any]:
    """Llama and Qwen: llama.cpp rotates whole heads, with keys and values of one head size (it asserts so)."""
    _full_rotary(gguf, config)
    return {}


def granite_config(gguf: GGUFModel, config: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers under llama.cpp's names; an absent one means what it means to llama.cpp (no
    scaling; an absent attention scale: head_dim ** -0.5). rope.scaling.finetuned false turns rotary off in
    llama.cpp's Granite, which strata's cannot do."""
    _full_rotary(gguf, config)
    if not gguf.get(".rope.scaling.finetuned", True):
        raise _refuse(gguf, "granite.rope.scaling.finetuned = false (layers without rotary) is not supported")
    names = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
             "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
    extra = {hf: float(gguf.get("." + key)) for key, hf in names.items() if gguf.get("." + key) is not None}
    extra.setdefault("attention_multiplier", config["head_dim"] ** -0.5)
    return extra
