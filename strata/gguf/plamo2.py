"""PLaMo2 GGUF files as llama.cpp's converter writes them (`general.architecture` plamo2): the config.json of the
checkpoint they came from, and their tensors under its names. The converter stores A = -exp(A_log), the conv weight
squeezed to [C, K], and every norm of a layer's sandwich (and the final norm) with the offset the checkpoint's model
adds already added (+1, +1/5, +1, +1/5^1.5; +1): those are subtracted back. The layer pattern is the per-layer head
counts (0: a Mamba layer); the file has no sliding window, and llama.cpp attends fully, as strata then does."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf import types
from strata.gguf.config import _eos_ids, _required
from strata.gguf.families import checkpoint_name, refuse_unknown_keys, refuse_unknown_tensors
from strata.gguf.reader import GGUFModel
from strata.gguf.ssm import _check_float, _float
from strata.gguf.weights import GGUFTensor, _meta, _tensor, is_blocked

# The plamo2.* keys the converter writes and this module reads; any other is refused by name.
KNOWN_KEYS = ("vocab_size", "attention.head_count", "attention.head_count_kv", "context_length", "embedding_length",
              "attention.key_length", "attention.value_length", "block_count", "attention.layer_norm_rms_epsilon",
              "rope.freq_base", "ssm.state_size", "ssm.conv_kernel", "ssm.time_step_rank", "ssm.inner_size",
              "ssm.group_count", "feed_forward_length")

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
# GGUF layer tensor -> the checkpoint's name under model.layers.layers.N
_LAYER = {"attn_norm.weight": "pre_mixer_norm.weight", "post_attention_norm": "post_mixer_norm.weight",
          "ffn_norm.weight": "pre_mlp_norm.weight", "post_ffw_norm": "post_mlp_norm.weight",
          "ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
          "ssm_in.weight": "mixer.in_proj.weight", "ssm_conv1d.weight": "mixer.conv1d.weight",
          "ssm_x.weight": "mixer.bcdt_proj.weight", "ssm_dt.weight": "mixer.dt_proj.weight",
          "ssm_dt.bias": "mixer.dt_bias", "ssm_a": "mixer.A_log", "ssm_d": "mixer.D",
          "ssm_dt_norm": "mixer.dt_norm_weight", "ssm_b_norm": "mixer.B_norm_weight",
          "ssm_c_norm": "mixer.C_norm_weight", "ssm_out.weight": "mixer.out_proj.weight",
          "attn_qkv.weight": "mixer.qkv_proj.weight", "attn_q_norm.weight": "mixer.q_weight",
          "attn_k_norm.weight": "mixer.k_weight", "attn_output.weight": "mixer.o_proj.weight"}
_LINEAR = ("ffn_up.weight", "ffn_down.weight", "ssm_in.weight", "ssm_x.weight", "ssm_dt.weight", "ssm_out.weight",
           "attn_qkv.weight", "attn_output.weight")
# What Plamo2Model.modify_tensors adds to each norm weight, written as it writes them (float32 sums of these).
NORM_OFFSETS = {"attn_norm.weight": 1.0, "post_attention_norm": 1.0 / 5, "ffn_norm.weight": 1.0,
                "post_ffw_norm": 1.0 / (5 ** 1.5), "output_norm.weight": 1.0}


def hf_config(gguf: GGUFModel) -> dict[str, Any]:
    """The config.json of the PLaMo2 checkpoint the file holds."""
    refuse_unknown_keys(gguf, KNOWN_KEYS)
    layers, hidden = _required(gguf, ".block_count"), _required(gguf, ".embedding_length")
    heads, kv_heads = (_per_layer(gguf, key, layers) for key in (".attention.head_count", ".attention.head_count_kv"))
    mamba = [h == 0 for h in heads]
    if [k == 0 for k in kv_heads] != mamba:
        raise UnsupportedModelError(f"{gguf.paths[0]}: plamo2.attention.head_count {heads} and head_count_kv "
                                    f"{kv_heads} disagree on which layers are Mamba layers", param="model")
    attention = {(h, k) for h, k in zip(heads, kv_heads, strict=True) if h}
    if len(attention) > 1:
        raise UnsupportedModelError(f"{gguf.paths[0]}: the attention layers' head counts differ ({sorted(attention)}),"
                                    " which strata's PLaMo2 does not support", param="model")
    q_heads, k_heads = attention.pop() if attention else (1, 1)
    head_dim, mamba_heads = _required(gguf, ".attention.key_length"), _required(gguf, ".ssm.time_step_rank")
    _check_shapes(gguf, head_dim, mamba_heads)
    return {
        "architectures": ["Plamo2ForCausalLM"], "model_type": "plamo2", "torch_dtype": "float32",
        "vocab_size": gguf.get(".vocab_size") or gguf.tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": q_heads, "num_key_value_heads": k_heads,
        "hidden_size_per_head": head_dim, "intermediate_size": _required(gguf, ".feed_forward_length"),
        "mamba_d_state": _required(gguf, ".ssm.state_size"), "mamba_d_conv": _required(gguf, ".ssm.conv_kernel"),
        "mamba_num_heads": mamba_heads, **_layer_pattern(gguf, mamba),
        "rms_norm_eps": _required(gguf, ".attention.layer_norm_rms_epsilon"),
        "rope_theta": gguf.get(".rope.freq_base", 10000.0),
        "max_position_embeddings": gguf.get(".context_length", 2048),
        # No window in the file: llama.cpp's PLaMo2 attends to every earlier token, and so does strata.
        "full_attention_idx": [i for i in range(layers) if not mamba[i]],
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"), "eos_token_id": _eos_ids(gguf),
    }


def _per_layer(gguf: GGUFModel, key: str, layers: int) -> list[int]:
    value = _required(gguf, key)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise ConfigError(f"{gguf.paths[0]}: plamo2{key} has {len(values)} entries for {layers} layers",
                          param="model")
    return values


def _check_shapes(gguf: GGUFModel, head_dim: int, mamba_heads: int) -> None:
    """strata's PLaMo2 has one head size for attention and Mamba heads, and one B/C shared by all Mamba heads."""
    if gguf.get(".attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{gguf.paths[0]}: plamo2.attention.value_length differs from key_length "
                                    f"{head_dim}", param="model")
    if gguf.get(".ssm.inner_size", mamba_heads * head_dim) != mamba_heads * head_dim:
        raise UnsupportedModelError(f"{gguf.paths[0]}: plamo2.ssm.inner_size={gguf.get('.ssm.inner_size')} is not "
                                    f"time_step_rank x key_length = {mamba_heads * head_dim}", param="model")
    if gguf.get(".ssm.group_count", 0) not in (0, 1):
        raise UnsupportedModelError(f"{gguf.paths[0]}: plamo2.ssm.group_count={gguf.get('.ssm.group_count')}; "
                                    "PLaMo2's Mamba heads share one B and C", param="model")


def _layer_pattern(gguf: GGUFModel, mamba: list[bool]) -> dict[str, Any]:
    """The mamba_step whose pattern (every step-th layer, offset step // 2, attends; with fewer layers than half a
    step, only the last) is the file's, as the converter derived the file's from it."""
    layers = len(mamba)
    if not any(mamba):
        return {"mamba_enabled": False, "mamba_step": 2}
    for step in range(2, 2 * layers + 2):
        if layers <= step // 2:
            pattern = [i != layers - 1 for i in range(layers)]
        else:
            pattern = [i % step != step // 2 for i in range(layers)]
        if pattern == mamba:
            return {"mamba_enabled": True, "mamba_step": step}
    described = "".join("M" if m else "A" for m in mamba)
    raise UnsupportedModelError(f"{gguf.paths[0]}: the layer pattern {described} (M: Mamba, A: attention) is no "
                                "PLaMo2 mamba_step's", param="model")


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint name of a GGUF tensor, or None for one strata does not know."""
    return checkpoint_name(gguf_name, _GLOBAL, _LAYER, "model.layers.layers")


def _is_linear(name: str) -> bool:
    return name in ("token_embd.weight", "output.weight") or name.endswith(_LINEAR)


def blocked_types(gguf: GGUFModel) -> dict[str, int]:
    """{checkpoint name: ggml type} of the linear layers kept in blocks (the fused qkv under the q/k/v names strata's
    PLaMo2 loads it by); norms, conv, A, D and dt bias load as float."""
    refuse_unknown_tensors(gguf, [n for n in gguf.tensors if hf_name(n) is None])
    found = {}
    for name, entry in gguf.tensors.items():
        if not _is_linear(name):
            _check_float(entry)
            continue
        types.check_type(entry.ggml_type, name)
        if not is_blocked(entry):
            continue
        target = hf_name(name)
        if name.endswith("attn_qkv.weight"):
            found.update({target.replace("qkv_proj", f"{p}_proj"): entry.ggml_type for p in "qkv"})
        else:
            found[target] = entry.ggml_type
    return found


def iterate(gguf: GGUFModel, skip: Callable[[str], bool] = lambda name: False, meta: bool = False
            ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(checkpoint name, tensor) for every tensor, in the checkpoint's layout."""
    for name, entry in gguf.tensors.items():
        target = hf_name(name)
        if skip(target):
            continue
        if _is_linear(name):
            yield target, _meta(entry) if meta else _tensor(entry, gguf.raw(name))
            continue
        if meta:
            yield target, torch.empty(_checkpoint_shape(name, entry.shape), device="meta")
            continue
        values = _float(gguf, entry)
        leaf = name.partition(".")[2].partition(".")[2] if name.startswith("blk.") else name
        if leaf in NORM_OFFSETS:
            values = values - NORM_OFFSETS[leaf]
        elif leaf == "ssm_a":  # A = -exp(A_log)
            values = torch.log(-values)
        yield target, values.reshape(_checkpoint_shape(name, entry.shape))


def _checkpoint_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The conv weight is [C, 1, K] in the checkpoint; the converter squeezed it."""
    return (shape[0], 1, shape[1]) if name.endswith("ssm_conv1d.weight") else shape
