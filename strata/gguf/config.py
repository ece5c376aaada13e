"""A GGUF model's metadata as the Hugging Face config.json its architecture would have: the sizes, rotary and
norm settings, special tokens and tied head strata's models read through `*Args.from_hf`."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf import variants
from strata.gguf.families import MODULES, family, refuse_unknown_keys
from strata.gguf.reader import GGUFModel


@dataclass(frozen=True)
class ArchitectureMap:
    """How one `general.architecture` becomes a config.json: the HF architecture, and whether llama.cpp's
    converter permuted the rows of attn_q / attn_k for its interleaved rotary (then undone on load); for Llama's
    variants, the config keys beyond Llama's, layer tensor names that mean something else, tensors read into the
    config, what the converter added to every norm weight, and the `ARCH.*` metadata keys strata reads (None: not
    checked)."""

    hf_architecture: str
    model_type: str
    permuted_qk: bool = False
    config: Callable[[GGUFModel, dict[str, Any]], dict[str, Any]] | None = None
    tensor_names: Mapping[str, str] = field(default_factory=dict)
    consumed_tensors: tuple[str, ...] = ()
    norm_offset: float = 0.0
    metadata_keys: frozenset[str] | None = None


ARCHITECTURES = {
    "llama": ArchitectureMap("LlamaForCausalLM", "llama", permuted_qk=True, config=variants.llama_config,
                             metadata_keys=variants.LLAMA_KEYS),
    "qwen2": ArchitectureMap("Qwen2ForCausalLM", "qwen2", config=variants.llama_config,
                             metadata_keys=variants.QWEN_KEYS),
    "qwen3": ArchitectureMap("Qwen3ForCausalLM", "qwen3", config=variants.llama_config,
                             metadata_keys=variants.QWEN_KEYS),
    "qwen3moe": ArchitectureMap("Qwen3MoeForCausalLM", "qwen3_moe", config=variants.llama_config,
                                metadata_keys=variants.QWEN3MOE_KEYS),
    # Gemma's norms scale by 1 + w; the converter stores 1 + w.
    "gemma2": ArchitectureMap("Gemma2ForCausalLM", "gemma2", config=variants.gemma2_config,
                              tensor_names=variants.GEMMA_TENSORS, norm_offset=1.0,
                              metadata_keys=variants.GEMMA2_KEYS),
    "gemma3": ArchitectureMap("Gemma3ForCausalLM", "gemma3_text", config=variants.gemma3_config,
                              tensor_names=variants.GEMMA_TENSORS, norm_offset=1.0,
                              metadata_keys=variants.GEMMA3_KEYS),
    "phi3": ArchitectureMap("Phi3ForCausalLM", "phi3", config=variants.phi3_config,
                            tensor_names=variants.PHI3_TENSORS, consumed_tensors=variants.PHI3_ROPE_FACTORS,
                            metadata_keys=variants.PHI3_KEYS),
    "granite": ArchitectureMap("GraniteForCausalLM", "granite", permuted_qk=True, config=variants.granite_config,
                               metadata_keys=variants.GRANITE_KEYS),
}


def architecture_map(gguf: GGUFModel) -> ArchitectureMap:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{gguf.paths[0]}: GGUF architecture {arch!r} is not supported; strata reads "
                                    f"GGUF files of {', '.join(sorted([*ARCHITECTURES, *MODULES]))}", param="model")
    return ARCHITECTURES[arch]


def _required(gguf: GGUFModel, key: str) -> Any:
    value = gguf.get(key)
    if value is None:
        raise ConfigError(f"{gguf.paths[0]}: the GGUF metadata lacks {gguf.architecture}{key}", param="model")
    return value


def _per_layer(gguf: GGUFModel, key: str, value: Any) -> Any:
    """Some files store a head count per layer; strata's models need one value for all layers."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"{gguf.paths[0]}: {gguf.architecture}{key} differs between layers "
                                        f"({sorted(set(value))}), which strata's models do not support",
                                        param="model")
        return value[0]
    return value


def hf_config(gguf: GGUFModel) -> dict[str, Any]:
    """The config.json of the model the file holds."""
    if (own := family(gguf.architecture)) is not None:
        return own.hf_config(gguf)
    arch = architecture_map(gguf)
    heads = _per_layer(gguf, ".attention.head_count", _required(gguf, ".attention.head_count"))
    kv_heads = _per_layer(gguf, ".attention.head_count_kv", gguf.get(".attention.head_count_kv", heads))
    hidden = _required(gguf, ".embedding_length")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(".vocab_size") or (len(tokens) if tokens else None) or gguf.tensors["token_embd.weight"].shape[0]
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture], "model_type": arch.model_type, "torch_dtype": "float32",
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": _required(gguf, ".block_count"),
        "intermediate_size": gguf.get(".feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": gguf.get(".attention.key_length", hidden // heads),
        "rms_norm_eps": gguf.get(".attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": gguf.get(".rope.freq_base", 10000.0),
        "max_position_embeddings": gguf.get(".context_length", 2048),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"), "eos_token_id": _eos_ids(gguf),
    }
    config["rope_scaling"] = _rope_scaling(gguf, config["head_dim"])
    config.update(_moe(gguf))
    sliding = gguf.get(".attention.sliding_window")
    if sliding:
        config["sliding_window"] = sliding
    if arch.model_type == "qwen3" or arch.model_type == "qwen3_moe":
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    if arch.metadata_keys is not None:
        refuse_unknown_keys(gguf, arch.metadata_keys)
    if arch.config is not None:
        config.update(arch.config(gguf, config))
    return config


def _eos_ids(gguf: GGUFModel) -> int | list[int] | None:
    """End of sequence, and end of turn where the file names another token for it (Llama 3 instruct files)."""
    ids = [gguf.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else (ids or None)


def _rope_scaling(gguf: GGUFModel, head_dim: int) -> dict[str, Any] | None:
    """Rotary scaling: llama.cpp writes Llama 3.1's as per-dimension frequency divisors in a tensor, not metadata."""
    if "rope_freqs.weight" in gguf.tensors:
        factors = gguf.raw("rope_freqs.weight").view("<f4").tolist()
        if len(factors) != head_dim // 2:
            raise ConfigError(f"{gguf.paths[0]}: rope_freqs.weight has {len(factors)} values, expected "
                              f"{head_dim // 2}", param="model")
        return {"rope_type": "freq_factors", "freq_factors": factors}
    kind = gguf.get(".rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind != "linear":
        raise UnsupportedModelError(f"{gguf.paths[0]}: rotary scaling {kind!r} in GGUF metadata is not supported "
                                    "(supported: linear, and llama3's rope_freqs)", param="model")
    return {"rope_type": "linear", "factor": gguf.get(".rope.scaling.factor", 1.0)}


def _moe(gguf: GGUFModel) -> dict[str, Any]:
    experts = gguf.get(".expert_count")
    if not experts:
        return {}
    return {"num_experts": experts, "num_experts_per_tok": gguf.get(".expert_used_count"),
            "moe_intermediate_size": gguf.get(".expert_feed_forward_length"), "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []}
