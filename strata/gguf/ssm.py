"""Mamba2 GGUF files as llama.cpp's converter writes them (`general.architecture` mamba2): the config.json of the
transformers checkpoint they came from, and their tensors under its names. The converter stores A = -exp(A_log)
(read back as log(-A)), the conv weight squeezed to [C, K], D and A as [H, 1], and the gated norm's weight as
[groups, inner / groups]; in_proj, out_proj, the embedding and the head may be in any ggml type strata runs."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf import types
from strata.gguf.config import _eos_ids, _required
from strata.gguf.families import checkpoint_name, refuse_unknown_keys, refuse_unknown_tensors
from strata.gguf.reader import GGUFModel, TensorEntry
from strata.gguf.weights import GGUFTensor, _meta, _tensor, is_blocked

# The mamba2.* keys the converter writes and this module reads. context_length is an arbitrary 2^20 the converter
# writes for every Mamba2 file (transformers' checkpoints have no such limit), so it changes nothing.
MAMBA2_KEYS = ("context_length", "embedding_length", "feed_forward_length", "attention.head_count", "block_count",
               "vocab_size", "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank",
               "ssm.group_count", "attention.layer_norm_rms_epsilon")

_MAMBA2_GLOBAL = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
                  "output.weight": "lm_head.weight"}
# GGUF layer tensor -> (checkpoint module under backbone.layers.N, whether it is a linear layer's weight)
_MAMBA2_LAYER = {"attn_norm.weight": "norm.weight", "ssm_in.weight": "mixer.in_proj.weight",
                 "ssm_out.weight": "mixer.out_proj.weight", "ssm_conv1d.weight": "mixer.conv1d.weight",
                 "ssm_conv1d.bias": "mixer.conv1d.bias", "ssm_dt.bias": "mixer.dt_bias", "ssm_a": "mixer.A_log",
                 "ssm_d": "mixer.D", "ssm_norm.weight": "mixer.norm.weight"}
_LINEAR = ("ssm_in.weight", "ssm_out.weight")
_FLOAT = (types.F32, types.F16, types.BF16)


def hf_config(gguf: GGUFModel) -> dict[str, Any]:
    """The config.json of the transformers Mamba2 checkpoint the file holds."""
    refuse_unknown_keys(gguf, MAMBA2_KEYS)
    for key in (".feed_forward_length", ".attention.head_count"):
        if gguf.get(key, 0) != 0:
            raise UnsupportedModelError(f"{gguf.paths[0]}: mamba2{key}={gguf.get(key)}; strata's Mamba2 has no "
                                        "attention or MLP layers", param="model")
    hidden, inner = _required(gguf, ".embedding_length"), _required(gguf, ".ssm.inner_size")
    heads = _required(gguf, ".ssm.time_step_rank")
    if inner % heads or inner % hidden:
        raise UnsupportedModelError(f"{gguf.paths[0]}: mamba2.ssm.inner_size={inner} must be a whole number of heads "
                                    f"({heads}) and of embedding_length ({hidden})", param="model")
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "torch_dtype": "float32",
        "vocab_size": gguf.tensors["token_embd.weight"].shape[0], "hidden_size": hidden,
        "num_hidden_layers": _required(gguf, ".block_count"), "num_heads": heads, "head_dim": inner // heads,
        "expand": inner // hidden, "state_size": _required(gguf, ".ssm.state_size"),
        "n_groups": gguf.get(".ssm.group_count", 1), "conv_kernel": _required(gguf, ".ssm.conv_kernel"),
        "layer_norm_epsilon": _required(gguf, ".attention.layer_norm_rms_epsilon"),
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in gguf.tensors, "use_bias": "blk.0.ssm_in.bias" in gguf.tensors,
        "residual_in_fp32": True, "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"), "eos_token_id": _eos_ids(gguf),
    }


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint name of a GGUF tensor, or None for one strata does not know."""
    return checkpoint_name(gguf_name, _MAMBA2_GLOBAL, _MAMBA2_LAYER, "backbone.layers")


def _is_linear(name: str) -> bool:
    return (name in _MAMBA2_GLOBAL and name != "output_norm.weight") or name.endswith(_LINEAR)


def blocked_types(gguf: GGUFModel) -> dict[str, int]:
    """{checkpoint name: ggml type} of the linear layers kept in blocks; the SSM's own tensors load as float."""
    refuse_unknown_tensors(gguf, [n for n in gguf.tensors if hf_name(n) is None])
    found = {}
    for name, entry in gguf.tensors.items():
        if not _is_linear(name):
            _check_float(entry)
            continue
        types.check_type(entry.ggml_type, name)
        if is_blocked(entry):
            found[hf_name(name)] = entry.ggml_type
    return found


def _check_float(entry: TensorEntry) -> None:
    if entry.ggml_type not in _FLOAT:
        raise ConfigError(f"GGUF tensor {entry.name!r} is {types.type_name(entry.ggml_type)}; strata reads it from "
                          "F32, F16 or BF16", param="model")


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
        values = torch.empty(entry.shape, device="meta") if meta else _float(gguf, entry)
        if name.endswith("ssm_a"):  # A = -exp(A_log), [H, 1]
            values = values.flatten() if meta else torch.log(-values.flatten())
        elif name.endswith(("ssm_d", "ssm_norm.weight")):  # [H, 1] and [groups, inner / groups]
            values = values.flatten()
        yield target, values


def _float(gguf: GGUFModel, entry: TensorEntry) -> torch.Tensor:
    raw = np.array(gguf.raw(entry.name))
    if entry.ggml_type == types.F32:
        return torch.from_numpy(raw.view("<f4")).reshape(entry.shape)
    half = torch.float16 if entry.ggml_type == types.F16 else torch.bfloat16
    return torch.from_numpy(raw.view("<i2")).view(half).float().reshape(entry.shape)
