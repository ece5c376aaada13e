"""Which tensor-parallel sizes a checkpoint allows: every width split across TP ranks must divide evenly (heads,
MLP and expert widths, Mamba heads and groups, the padded vocabulary, the vision tower, quantization groups)."""
from __future__ import annotations

from strata.config.hf_config import HFConfig
from strata.config.quant_config import QuantConfig, quant_tp_problem
from strata.distributed import pad_vocab
from strata.errors import ConfigError


def num_routed_experts(text: HFConfig) -> int:
    """Routed experts per MoE layer; 0 for dense models (and MoE configs whose MoE layer list is empty)."""
    experts = text.get("num_local_experts") or text.get("num_experts") or text.get("n_routed_experts") or 0
    if text.get("moe_layers") == [] or text.get("interleave_moe_layer_step", 1) == 0:
        return 0
    return int(experts)


def check_vision_tp(tp: int, vision: HFConfig | None) -> None:
    """The vision tower is split by heads and by the widths of its MLP and adapter."""
    if vision is None:
        return
    for name in ("num_attention_heads", "intermediate_size", "projector_input_dim"):
        size = vision.get(name)
        if isinstance(size, int) and size % tp:
            works = [t for t in range(1, min(size, 64) + 1) if size % t == 0]
            raise ConfigError(f"tensor_parallel_size={tp} must divide vision_config.{name}={size} (the vision "
                              f"encoder is split across TP ranks too); sizes that work for it: "
                              f"{', '.join(map(str, works))}", param="tensor_parallel_size")


# Sizes split evenly across TP ranks, when the checkpoint has them: attention heads, dense and expert MLP
# widths, Mamba heads.
_TP_DIVIDES = ("num_attention_heads", "intermediate_size", "intermediate_size_mlp", "moe_intermediate_size",
               "num_heads", "mamba_num_heads")


def tp_problem(tp: int, text: HFConfig) -> str | None:
    """Why `tp` cannot shard this language model, or None when it can."""
    for name in _TP_DIVIDES:
        size = text.get(name)
        if isinstance(size, int) and size % tp:
            return f"tensor_parallel_size={tp} must divide {name}={size}"
    groups = text.get("n_groups")  # Mamba2 B/C groups: split across ranks, or one group that every rank holds
    if isinstance(groups, int) and groups > 1 and groups % tp:
        return f"tensor_parallel_size={tp} must divide n_groups={groups} (the Mamba B/C groups)"
    kv_heads = text.get("num_key_value_heads", text.get("num_attention_heads"))
    if isinstance(kv_heads, int) and kv_heads % tp and tp % kv_heads:
        return (f"tensor_parallel_size={tp} must divide num_key_value_heads={kv_heads} or be a multiple of it "
                "(KV heads are then replicated)")
    vocab = text.get("vocab_size")
    if isinstance(vocab, int) and pad_vocab(vocab) % tp:
        return (f"tensor_parallel_size={tp} must divide the padded vocabulary {pad_vocab(vocab)} "
                f"(vocab_size={vocab} rounded up to a multiple of 64)")
    return None


def row_parallel_inputs(text: HFConfig) -> dict[str, int]:
    """The input widths of layers split along their inputs across TP ranks (o_proj, down_proj, out_proj)."""
    sizes = {name: text.get(name) for name in ("intermediate_size", "intermediate_size_mlp",
                                                "moe_intermediate_size")}
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    if isinstance(heads, int) and isinstance(hidden, int):
        sizes["num_attention_heads * head_dim"] = heads * _head_dim(text)
    if isinstance(text.get("expand"), int) and isinstance(hidden, int):  # Mamba2's inner width
        sizes["expand * hidden_size"] = text.get("expand") * hidden
    if isinstance(text.get("mamba_num_heads"), int):  # PLaMo2's Mamba inner width
        sizes["mamba_num_heads * hidden_size_per_head"] = text.get("mamba_num_heads") * text.get(
            "hidden_size_per_head", 128)
    return {k: v for k, v in sizes.items() if isinstance(v, int)}


def _head_dim(text: HFConfig) -> int:
    return text.get("head_dim") or text.get("hidden_size_per_head") or text.hidden_size // text.num_attention_heads


def column_parallel_outputs(text: HFConfig) -> dict[str, tuple[int, int]]:
    """The output pieces of layers split along their outputs across TP ranks, as (rows, units): q/k/v, the MLP
    widths, and Mamba's z/x/B/C/dt pieces (its in_proj, and PLaMo2's dt_proj); units are heads or groups."""
    pieces: dict[str, tuple[int, int]] = {}
    heads = text.get("num_attention_heads")
    if isinstance(heads, int) and isinstance(text.get("hidden_size"), int):
        kv = text.get("num_key_value_heads") or heads
        pieces["num_attention_heads * head_dim"] = (heads * _head_dim(text), heads)
        pieces["num_key_value_heads * head_dim"] = (kv * _head_dim(text), kv)
    for name in ("intermediate_size", "intermediate_size_mlp", "moe_intermediate_size"):
        if isinstance(text.get(name), int):
            pieces[name] = (text.get(name), text.get(name))
    mamba_heads = text.get("num_heads")
    if isinstance(mamba_heads, int) and isinstance(text.get("state_size"), int):  # Mamba2
        groups = text.get("n_groups", 1)
        pieces["num_heads * head_dim"] = (mamba_heads * text.get("head_dim"), mamba_heads)
        pieces["n_groups * state_size"] = (groups * text.get("state_size"), groups)
        pieces["num_heads (dt)"] = (mamba_heads, mamba_heads)
    mamba_heads = text.get("mamba_num_heads")
    if isinstance(mamba_heads, int):  # PLaMo2
        pieces["mamba_num_heads * hidden_size_per_head"] = (mamba_heads * _head_dim(text), mamba_heads)
        pieces["mamba_num_heads (dt)"] = (mamba_heads, mamba_heads)
    return pieces


def check_quant_tp(tp: int, quant: QuantConfig | None, text: HFConfig) -> None:
    problem = quant and quant_tp_problem(tp, quant, row_parallel_inputs(text), column_parallel_outputs(text))
    if problem:
        raise ConfigError(problem, param="tensor_parallel_size")


def valid_tp_sizes(text: HFConfig, limit: int = 64) -> list[int]:
    return [t for t in range(1, limit + 1) if tp_problem(t, text) is None]


def check_tp(tp: int, text: HFConfig) -> None:
    problem = tp_problem(tp, text)
    if problem is not None:
        raise ConfigError(f"{problem}; sizes that work for this model: {', '.join(map(str, valid_tp_sizes(text)))}",
                          param="tensor_parallel_size")
