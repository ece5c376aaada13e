"""Quantized checkpoint formats as read from config.json's `quantization_config` (compressed-tensors, GPTQ, AWQ,
FP8): one frozen `LinearScheme` per group of linear layers, which layers it targets, and which it ignores; gpt-oss's
MXFP4 experts have a config of their own, MXFP4QuantConfig.

Everything here is checked before any process starts; an unsupported scheme is a ConfigError naming the field.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from strata.errors import ConfigError
from strata.gguf import types as gguf_types

# vLLM's names, accepted by `quantization=` to insist on what the checkpoint declares.
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "mxfp4")
EXPERTS_INT8 = "experts_int8"  # not a checkpoint format: quantizes the MoE experts while loading

PACKED, INT8_W8A8, FP8, GPTQ, AWQ = "pack-quantized", "int-quantized", "float-quantized", "gptq", "awq"


@dataclass(frozen=True)
class LinearScheme:
    """How one linear layer's weight is stored. `group_size` -1 = one scale per output channel, 0 = per tensor."""

    format: str  # PACKED | INT8_W8A8 | FP8 | GPTQ | AWQ
    bits: int
    group_size: int
    symmetric: bool
    act_order: bool = False  # a g_idx tensor gives each input row's group
    dynamic_activations: bool = False  # activations quantized per token at run time (W8A8 int8, FP8)
    zeros_minus_one: bool = False  # GPTQ v1 stores zero points minus one

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def inputs_per_element(self) -> int:
        """Inputs (K) one stored element covers: the weights are packed along K (pack-quantized, GPTQ)."""
        return self.pack_factor if self.format in (PACKED, GPTQ) else 1

    @property
    def outputs_per_element(self) -> int:
        """Outputs (N) one stored element covers: zero points packed along N (asymmetric pack-quantized,
        GPTQ), or AWQ's weights, packed along N too."""
        if self.format == AWQ or self.format == GPTQ or (self.format == PACKED and not self.symmetric):
            return self.pack_factor
        return 1


@dataclass(frozen=True)
class QuantConfig:
    method: str
    groups: tuple[tuple[tuple[str, ...], LinearScheme], ...]  # (targets, scheme), first match wins
    ignore: tuple[str, ...] = ()
    # Whether an untied LM head is stored quantized when the groups and `ignore` say so (compressed-tensors);
    # GPTQ says it with its own `lm_head` flag, AWQ and FP8 checkpoints keep the head as it is.
    lm_head: bool = False

    def scheme_for(self, names: list[str]) -> LinearScheme | None:
        """The scheme of the linear layer stored under checkpoint module `names` (several for a fused layer,
        e.g. q_proj, k_proj and v_proj); None when the checkpoint leaves it unquantized."""
        ignored = [_matches(self.ignore, n) for n in names]
        if any(ignored) and not all(ignored):
            raise ConfigError(f"quantization_config.ignore lists only some of {', '.join(names)}, which strata "
                              "runs as one fused layer: quantize all of them or none", param="quantization")
        if all(ignored):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" for t in targets) or all(_matches(targets, n) for n in names):
                return scheme
        return None


@dataclass(frozen=True)
class GGUFQuantConfig:
    """A GGUF file's layers: each tensor kept in its ggml blocks, by checkpoint (HF) name, with its ggml type."""

    tensor_types: dict[str, int]
    method: str = "gguf"
    activations: str = "float"  # "int8": products round x to Q8_0 / Q8_K as llama.cpp does (quantized_activations)

    def types_of(self, module_names: list[str]) -> dict[str, int]:
        """{checkpoint module name: ggml type} of the modules (several for a fused layer) stored in blocks."""
        return {n: self.tensor_types[n + ".weight"] for n in module_names if n + ".weight" in self.tensor_types}


@dataclass(frozen=True)
class MXFP4QuantConfig:
    """gpt-oss's MXFP4 checkpoints: the MoE experts' projections stored as `*_blocks` / `*_scales` pairs
    (strata/layers/quantization/mxfp4.py), every other layer (attention, router, embeddings, head) as it is. No
    linear layer takes a scheme of QuantConfig's (`scheme_for` is None): the MoE layer reads the experts itself."""

    modules_to_not_convert: tuple[str, ...] = ()  # checkpoint module names, `*` wildcards as transformers writes them
    method: str = "mxfp4"
    lm_head: bool = False
    groups: tuple = ()

    def scheme_for(self, names: list[str]) -> None:
        return None

    def experts_quantized(self, module_name: str) -> bool:
        """Whether the experts under checkpoint module `module_name` (e.g. model.layers.3.mlp.experts) are MXFP4."""
        return not any(fnmatch.fnmatchcase(module_name, p) or fnmatch.fnmatchcase(module_name, p + ".*")
                       for p in self.modules_to_not_convert)


def _matches(patterns: tuple[str, ...], name: str) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


def parse_quant_config(raw: dict[str, Any] | None,
                       requested: str | None) -> QuantConfig | MXFP4QuantConfig | None:
    """config.json's `quantization_config` (and the user's `quantization=`) -> QuantConfig, or None."""
    if requested == EXPERTS_INT8:
        if raw:
            raise ConfigError(f"quantization='experts_int8' quantizes full-precision experts, but this checkpoint "
                              f"is already quantized ({raw.get('quant_method')}); leave quantization unset",
                              param="quantization")
        return None
    if not raw:
        if requested is not None:
            raise ConfigError(f"quantization={requested!r} was asked for, but the checkpoint's config.json has no "
                              "quantization_config", param="quantization")
        return None
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_METHODS:
        raise ConfigError(f"quantization_config.quant_method {raw.get('quant_method')!r} is not supported "
                          f"(supported: {', '.join(CHECKPOINT_METHODS)})", param="quantization")
    if requested is not None and requested != method:
        raise ConfigError(f"quantization={requested!r} was asked for, but the checkpoint is {method}",
                          param="quantization")
    parse = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq, "fp8": _fp8,
             "mxfp4": _mxfp4}[method]
    return parse(raw)


def _field(raw: dict[str, Any], key: str, where: str, allowed: tuple | None = None) -> Any:
    if key not in raw:
        raise ConfigError(f"{where}.{key} is missing", param="quantization")
    value = raw[key]
    if allowed is not None and value not in allowed:
        raise ConfigError(f"{where}.{key}={value!r} is not supported (supported: "
                          f"{', '.join(map(str, allowed))})", param="quantization")
    return value


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    groups = []
    for name, group in (raw.get("config_groups") or {}).items():
        where = f"quantization_config.config_groups.{name}"
        fmt = group.get("format") or raw.get("format")
        _field({"format": fmt}, "format", where, (PACKED, INT8_W8A8, FP8))
        weights = _field(group, "weights", where)
        w_where = where + ".weights"
        kind = _field(weights, "type", w_where, ("int", "float"))
        bits = _field(weights, "num_bits", w_where, (4, 8) if kind == "int" else (8,))
        strategy = _field(weights, "strategy", w_where, ("group", "channel") if kind == "int"
                          else ("channel", "tensor"))
        group_size = {"group": weights.get("group_size"), "channel": -1, "tensor": 0}[strategy]
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise ConfigError(f"{w_where}.group_size must be a positive integer with strategy 'group', "
                              f"got {group_size!r}", param="quantization")
        if (kind == "float") != (fmt == FP8) or (fmt == INT8_W8A8 and bits != 8):
            raise ConfigError(f"{where}: format {fmt!r} does not store {bits}-bit {kind} weights",
                              param="quantization")
        acts = group.get("input_activations")
        if fmt == PACKED and acts:
            raise ConfigError(f"{where}.input_activations: pack-quantized weights with quantized activations are "
                              "not supported (W4A16/W8A16 only)", param="quantization")
        if acts and not acts.get("dynamic"):
            raise ConfigError(f"{where}.input_activations: static activation scales are not supported "
                              "(dynamic per-token only)", param="quantization")
        if acts and acts.get("dynamic") and acts.get("strategy") not in ("token", "tensor"):
            raise ConfigError(f"{where}.input_activations.strategy {acts.get('strategy')!r} is not supported "
                              "(token or tensor)", param="quantization")
        act_order = weights.get("actorder") == "group"
        groups.append((tuple(group.get("targets") or ["Linear"]),
                       LinearScheme(fmt, bits, group_size, bool(weights.get("symmetric", True)), act_order,
                                    bool(acts))))
    if not groups:
        raise ConfigError("quantization_config.config_groups is empty", param="quantization")
    return QuantConfig("compressed-tensors", tuple(groups), tuple(raw.get("ignore") or ()), lm_head=True)


def _gptq(raw: dict[str, Any]) -> QuantConfig:
    where = "quantization_config"
    bits = _field(raw, "bits", where, (4, 8))
    group_size = int(_field(raw, "group_size", where))
    v2 = raw.get("checkpoint_format") == "gptq_v2"
    scheme = LinearScheme(GPTQ, bits, group_size, bool(raw.get("sym", True)), bool(raw.get("desc_act", False)),
                          zeros_minus_one=not v2)
    return QuantConfig("gptq", ((("Linear",), scheme),), tuple(raw.get("modules_to_not_convert") or ()),
                       lm_head=bool(raw.get("lm_head", False)))


def _awq(raw: dict[str, Any]) -> QuantConfig:
    where = "quantization_config"
    bits = _field(raw, "w_bit", where, (4,)) if "w_bit" in raw else _field(raw, "bits", where, (4,))
    group_size = int(raw.get("q_group_size", raw.get("group_size", 128)))
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"{where}.version={version!r} is not supported (gemm)", param="quantization")
    if not raw.get("zero_point", True):
        raise ConfigError(f"{where}.zero_point=false is not supported (AWQ GEMM checkpoints are asymmetric)",
                          param="quantization")
    scheme = LinearScheme(AWQ, bits, group_size, False)
    return QuantConfig("awq", ((("Linear",), scheme),), tuple(raw.get("modules_to_not_convert") or ()))


def _fp8(raw: dict[str, Any]) -> QuantConfig:
    if raw.get("weight_block_size"):
        raise ConfigError("quantization_config.weight_block_size: block-wise FP8 is not supported",
                          param="quantization")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme={raw.get('activation_scheme')!r} is not "
                          "supported (dynamic)", param="quantization")
    scheme = LinearScheme(FP8, 8, 0, True, dynamic_activations=True)
    return QuantConfig("fp8", ((("Linear",), scheme),), tuple(raw.get("ignored_layers") or ()))


def _mxfp4(raw: dict[str, Any]) -> MXFP4QuantConfig:
    skip = raw.get("modules_to_not_convert") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(p, str) for p in skip):
        raise ConfigError(f"quantization_config.modules_to_not_convert must be a list of module names, got {skip!r}",
                          param="quantization")
    return MXFP4QuantConfig(tuple(skip))


def quant_tp_problem(tp: int, quant: QuantConfig | GGUFQuantConfig | MXFP4QuantConfig,
                     row_parallel_inputs: dict[str, int],
                     column_parallel_outputs: dict[str, tuple[int, int]] | None = None) -> str | None:
    """Why `tp` would cut a quantization group, a packed element or a ggml block: of a row-parallel layer's inputs
    (split across ranks), or of a column-parallel piece's outputs ((rows, units): units split across ranks, or,
    when fewer than ranks, each rank holds one); None when it cuts nothing."""
    columns = column_parallel_outputs or {}
    cut_by = (_gguf_cut_by if isinstance(quant, GGUFQuantConfig) else _mxfp4_cut_by
              if isinstance(quant, MXFP4QuantConfig) else _cut_by)
    problem = cut_by(tp, quant, row_parallel_inputs, columns)
    if problem is None:
        return None
    works = [t for t in (1, 2, 3, 4, 6, 8, 16, 32, 64) if all(s % t == 0 for s in row_parallel_inputs.values())
             and cut_by(t, quant, row_parallel_inputs, columns) is None]
    return f"{problem}; sizes that work: {', '.join(map(str, works))}"


def _cut_by(tp: int, quant: QuantConfig, rows: dict[str, int], columns: dict[str, tuple[int, int]]) -> str | None:
    schemes = sorted({s for _, s in quant.groups}, key=lambda s: (s.group_size, s.bits, s.format))
    for s in schemes:
        for name, size in rows.items():
            local = size // tp
            if tp == 1 or size % tp:
                continue
            if 0 < s.group_size and local % s.group_size:
                return (f"tensor_parallel_size={tp} splits {name}={size} into {local} inputs per rank, which cuts a "
                        f"quantization group of {s.group_size}")
            if local % s.inputs_per_element:
                return (f"tensor_parallel_size={tp} splits {name}={size} into {local} inputs per rank, which cuts a "
                        f"packed element of {s.inputs_per_element} inputs ({s.bits}-bit {s.format} weights)")
        for name, (size, units) in columns.items():
            if tp == 1 or (units % tp and tp % units):
                continue
            local = size // units * max(1, units // tp)
            if local % s.outputs_per_element:
                return (f"tensor_parallel_size={tp} leaves {local} rows of {name}={size} on each rank, which cuts a "
                        f"packed element of {s.outputs_per_element} outputs ({s.bits}-bit {s.format} "
                        f"{'weights' if s.format == AWQ else 'zero points'} are packed along the outputs)")
    return None


def _gguf_cut_by(tp: int, quant: GGUFQuantConfig, rows: dict[str, int], columns: dict) -> str | None:
    """GGUF rows are cut only at whole blocks: a row-parallel layer's inputs per rank must hold whole blocks of the
    types its tensors are stored in (32 values, 256 for the K-quants); gpt-oss's MXFP4 experts as checkpoints' are."""
    if gguf_types.MXFP4 in quant.tensor_types.values():
        problem = _mxfp4_cut_by(tp, MXFP4QuantConfig(), rows, columns)
        if problem is not None:
            return problem
    problem = _gguf_experts_cut_by(tp, quant, rows)
    if problem is not None:
        return problem
    row_parallel = [t for name, t in quant.tensor_types.items()
                    if name.endswith(_ROW_PARALLEL) and _EXPERTS_DOWN not in name]
    block = max((gguf_types.check_type(t, "").values_per_block for t in row_parallel), default=1)
    for name, size in rows.items():
        if tp > 1 and size % tp == 0 and (size // tp) % block:
            return (f"tensor_parallel_size={tp} splits {name}={size} into {size // tp} inputs per rank, which cuts "
                    f"a GGUF block of {block} values")
    return None


def _gguf_experts_cut_by(tp: int, quant: GGUFQuantConfig, rows: dict[str, int]) -> str | None:
    """Routed experts kept in ggml blocks split each down projection's inputs (the expert width: Qwen3-MoE's
    moe_intermediate_size, Llama 4's intermediate_size) across ranks: each share must hold whole blocks."""
    width = "moe_intermediate_size" if "moe_intermediate_size" in rows else "intermediate_size"
    size = rows.get(width)
    if tp == 1 or size is None or size % tp:
        return None
    for name, qtype in quant.tensor_types.items():
        block = gguf_types.TYPES.get(qtype)
        if _EXPERTS_DOWN in name and block is not None and (size // tp) % block.values_per_block:
            layer = re.search(r"layers\.(\d+)\.", name)
            tensor = f"blk.{layer.group(1)}.ffn_down_exps.weight" if layer else name
            return (f"tensor_parallel_size={tp} splits the inputs of GGUF tensor {tensor!r} ({block.name}, blocks of "
                    f"{block.values_per_block} values; {width}={size}) into {size // tp} per rank, which cuts a block")
    return None


def _mxfp4_cut_by(tp: int, quant: MXFP4QuantConfig, rows: dict[str, int], columns: dict) -> str | None:
    """The experts' down projections are split along their inputs (the intermediate width): each rank's share must
    hold whole MXFP4 blocks of 32 values."""
    for name in ("intermediate_size", "moe_intermediate_size"):
        size = rows.get(name)
        if size is not None and tp > 1 and size % tp == 0 and (size // tp) % 32:
            return (f"tensor_parallel_size={tp} splits {name}={size} into {size // tp} inputs per rank, which cuts "
                    "an MXFP4 block of 32 values")
    return None


_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
_EXPERTS_DOWN = ".experts.down_proj.weight"  # GGUF routed experts kept in blocks (strata.gguf.weights)
