"""gpt-oss GGUF files as llama.cpp's converter writes them (`general.architecture` gpt-oss): the config.json of the
checkpoint they came from, and their tensors under its names. The routed experts are llama.cpp's MXFP4 blocks
(gate and up as separate tensors), repacked at load into the layout of gpt-oss's own MXFP4 checkpoints, still 4-bit
(strata/layers/quantization/mxfp4.py runs them); float experts (F32/F16/BF16) load as float."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf import types
from strata.gguf.config import _eos_ids, _per_layer, _required
from strata.gguf.families import refuse_unknown_keys, refuse_unknown_tensors
from strata.gguf.reader import GGUFModel
from strata.gguf.weights import GGUFTensor, _meta, _tensor, is_blocked

# The gpt-oss.* keys the converter writes and this module reads; any other is refused by name.
KNOWN_KEYS = (
    "block_count", "context_length", "embedding_length", "feed_forward_length", "expert_feed_forward_length",
    "vocab_size", "expert_count", "expert_used_count", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base", "rope.freq_base_swa",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_attn_factor")
# llama.cpp's SwiGLU for gpt-oss has these constants built in (LLM_FFN_SWIGLU_OAI_MOE); the file does not carry them.
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
_FLOAT = (types.F32, types.F16, types.BF16)


def hf_config(gguf: GGUFModel) -> dict[str, Any]:
    """The config.json of the gpt-oss checkpoint the file holds."""
    refuse_unknown_keys(gguf, KNOWN_KEYS)
    heads = _per_layer(gguf, ".attention.head_count", _required(gguf, ".attention.head_count"))
    layers, hidden = _required(gguf, ".block_count"), _required(gguf, ".embedding_length")
    head_dim = gguf.get(".attention.key_length", hidden // heads)
    for key in (".attention.value_length", ".rope.dimension_count"):
        if gguf.get(key, head_dim) != head_dim:
            raise UnsupportedModelError(f"{gguf.paths[0]}: gpt-oss{key}={gguf.get(key)} differs from the head size "
                                        f"{head_dim}, which strata's gpt-oss does not support", param="model")
    base = gguf.get(".rope.freq_base", 10000.0)
    if gguf.get(".rope.freq_base_swa", base) != base:
        raise UnsupportedModelError(f"{gguf.paths[0]}: gpt-oss.rope.freq_base_swa differs from rope.freq_base; "
                                    "strata's gpt-oss rotates every layer alike", param="model")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(".vocab_size") or (len(tokens) if tokens else gguf.tensors["token_embd.weight"].shape[0])
    kv_heads = _per_layer(gguf, ".attention.head_count_kv", gguf.get(".attention.head_count_kv", heads))
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "torch_dtype": "float32",
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": gguf.get(".expert_feed_forward_length",
                                                            gguf.get(".feed_forward_length")),
        "num_local_experts": _required(gguf, ".expert_count"),
        "num_experts_per_tok": _per_layer(gguf, ".expert_used_count", _required(gguf, ".expert_used_count")),
        "rms_norm_eps": _required(gguf, ".attention.layer_norm_rms_epsilon"), "attention_bias": True,
        "max_position_embeddings": gguf.get(".context_length", 131072), "rope_parameters": _rope(gguf, base),
        "sliding_window": _required(gguf, ".attention.sliding_window"), "layer_types": _layer_types(gguf, layers),
        "swiglu_limit": SWIGLU_LIMIT, "swiglu_alpha": SWIGLU_ALPHA,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"), "eos_token_id": _eos_ids(gguf),
    }


def _rope(gguf: GGUFModel, base: float) -> dict[str, Any]:
    """YaRN as gpt-oss's checkpoints state it. Their config says `truncate: false` (the correction range is not
    rounded to whole dimensions); the file cannot say it, and the checkpoint is what the file must reproduce."""
    kind = gguf.get(".rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": base}
    if kind != "yarn":
        raise UnsupportedModelError(f"{gguf.paths[0]}: gpt-oss rotary scaling {kind!r} is not supported (strata "
                                    "reads yarn, or none)", param="model")
    params = {"rope_type": "yarn", "rope_theta": base, "factor": float(_required(gguf, ".rope.scaling.factor")),
              "original_max_position_embeddings": gguf.get(".rope.scaling.original_context_length",
                                                           gguf.get(".context_length")),
              "beta_fast": float(gguf.get(".rope.scaling.yarn_beta_fast", 32.0)),
              "beta_slow": float(gguf.get(".rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    if gguf.get(".rope.scaling.yarn_attn_factor") is not None:
        params["attention_factor"] = float(gguf.get(".rope.scaling.yarn_attn_factor"))
    return params


def _layer_types(gguf: GGUFModel, layers: int) -> list[str]:
    """Which layers slide, as llama.cpp reads it: a per-layer list, or a period n (the last layer of every n
    attends fully; 2 when absent: layers 0, 2, 4... slide)."""
    pattern = gguf.get(".attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ConfigError(f"{gguf.paths[0]}: gpt-oss.attention.sliding_window_pattern has {len(pattern)} "
                              f"entries for {layers} layers", param="model")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint name of a tensor other than the experts', or None for one strata does not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None:
        return None
    layer, kind, suffix = match.groups()
    if kind == "attn_sinks" and suffix == "weight":
        return f"model.layers.{layer}.self_attn.sinks"
    return f"model.layers.{layer}.{_LAYER[kind]}.{suffix}" if kind in _LAYER else None


def blocked_types(gguf: GGUFModel) -> dict[str, int]:
    """{checkpoint name: ggml type} of the tensors kept in blocks: linear layers in any type strata runs, and the
    experts' MXFP4 blocks (`...experts.gate_up_proj_blocks` / `down_proj_blocks`)."""
    refuse_unknown_tensors(gguf, [n for n in gguf.tensors if hf_name(n) is None and not _EXPERTS.match(n)])
    found = {}
    for name, entry in gguf.tensors.items():
        match = _EXPERTS.match(name)
        if match is None:
            types.check_type(entry.ggml_type, name)
            if is_blocked(entry):
                found[hf_name(name)] = entry.ggml_type
            continue
        layer, proj, suffix = match.groups()
        if suffix == "bias":
            if entry.ggml_type not in _FLOAT:
                raise ConfigError(f"GGUF tensor {name!r} is {types.type_name(entry.ggml_type)}; strata reads expert "
                                  "biases stored as F32, F16 or BF16", param="model")
            continue
        kind = _expert_type(gguf, int(layer))
        if kind == types.MXFP4:
            found[f"model.layers.{layer}.mlp.experts.{'down' if proj == 'down' else 'gate_up'}_proj_blocks"] = kind
    return found


def _expert_type(gguf: GGUFModel, layer: int) -> int:
    """The one type of a layer's three expert tensors: MXFP4, or a float type; others are refused."""
    names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    kinds = {gguf.tensors[n].ggml_type for n in names if n in gguf.tensors}
    if len(kinds) != 1 or not kinds <= {types.MXFP4, *_FLOAT}:
        described = ", ".join(f"{n}: {types.type_name(gguf.tensors[n].ggml_type)}" for n in names if n in gguf.tensors)
        raise ConfigError(f"{gguf.paths[0]}: strata runs gpt-oss experts stored as MXFP4 (or F32/F16/BF16), all three "
                          f"projections of a layer alike; layer {layer} has {described}", param="model")
    return kinds.pop()


def iterate(gguf: GGUFModel, skip: Callable[[str], bool] = lambda name: False, meta: bool = False
            ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(checkpoint name, tensor) for every tensor; the experts as the released MXFP4 checkpoints store them (gate
    and up in alternate rows of one gate_up tensor), or as transformers' float checkpoints do."""
    for name, entry in gguf.tensors.items():
        match = _EXPERTS.match(name)
        if match is not None:
            layer, proj, suffix = match.groups()
            prefix = f"model.layers.{layer}.mlp.experts"
            if proj != "up" and not skip(prefix):
                yield from _experts(gguf, prefix, f"blk.{layer}.ffn_", proj, suffix, meta)
            continue
        target = hf_name(name)
        if not skip(target):
            yield target, _meta(entry) if meta else _tensor(entry, gguf.raw(name))


def _experts(gguf: GGUFModel, prefix: str, blk: str, proj: str, suffix: str, meta: bool
             ) -> Iterator[tuple[str, torch.Tensor]]:
    names = [f"{blk}{p}_exps.{suffix}" for p in (("gate", "up") if proj == "gate" else ("down",))]
    target = f"{prefix}.{'gate_up_proj' if proj == 'gate' else 'down_proj'}"
    if suffix == "bias":  # [E, I] each; gate_up_proj_bias holds gate and up in alternate columns
        parts = [_float(gguf, n, meta) for n in names]
        yield f"{target}_bias", torch.stack(parts, dim=-1).flatten(-2) if len(parts) == 2 else parts[0]
    elif gguf.tensors[names[0]].ggml_type == types.MXFP4:  # blocks [E, out, in/32, 16], scales [E, out, in/32]
        pieces = [_mxfp4(gguf, n, meta) for n in names]
        blocks, scales = (torch.stack([p[i] for p in pieces], dim=2).flatten(1, 2) if len(pieces) == 2 else pieces[0][i]
                          for i in (0, 1))
        yield f"{target}_blocks", blocks
        yield f"{target}_scales", scales
    else:  # transformers' float experts, used as x @ W: gate_up [E, H, 2I] (gate and up alternate), down [E, I, H]
        parts = [_float(gguf, n, meta).transpose(1, 2) for n in names]
        yield target, torch.stack(parts, dim=-1).flatten(-2) if len(parts) == 2 else parts[0]


def _float(gguf: GGUFModel, name: str, meta: bool) -> torch.Tensor:
    entry = gguf.tensors[name]
    if meta:
        return torch.empty(entry.shape, dtype=torch.float32, device="meta")
    if entry.ggml_type == types.F32:
        return torch.from_numpy(np.array(gguf.raw(name)).view("<f4")).reshape(entry.shape)
    half = torch.float16 if entry.ggml_type == types.F16 else torch.bfloat16
    return torch.from_numpy(np.array(gguf.raw(name)).view("<i2")).view(half).float().reshape(entry.shape)


def _mxfp4(gguf: GGUFModel, name: str, meta: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's MXFP4 tensor [E, N, K] as (blocks [E, N, K/32, 16], scales [E, N, K/32]): each 17-byte block's
    exponent byte first, then its codes; ggml holds value j in the low nibble of code byte j and value j + 16 in
    its high one, the checkpoints value 2j in the low nibble of byte j and 2j + 1 in its high one. Same codes,
    same exponents: a reordering of nibbles, nothing dequantized."""
    entry = gguf.tensors[name]
    *outer, k = entry.shape
    groups = k // 32
    if meta:
        return (torch.empty(*outer, groups, 16, dtype=torch.uint8, device="meta"),
                torch.empty(*outer, groups, dtype=torch.uint8, device="meta"))
    data = torch.from_numpy(np.array(gguf.raw(name))).view(*outer, groups, 17)
    codes = data[..., 1:]
    values = torch.cat((codes & 15, codes >> 4), dim=-1)  # the block's 32 codes in order
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous(), data[..., 0].contiguous()
