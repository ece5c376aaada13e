"""Linear layers of a quantized checkpoint: their stored tensors replace `weight`, each loaded through a loader that
keeps this rank's part along the right dimension; after loading they become one canonical `QuantizedWeight`
(FP8 stays FP8, widened in the kernel's registers)."""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch
from torch import nn

from strata.config.quant_config import FP8, INT8_W8A8, GGUFQuantConfig, LinearScheme, MXFP4QuantConfig, QuantConfig
from strata.errors import ConfigError
from strata.gguf import types as gguf_types
from strata.kernels.cpu import cpu_kernels_apply, crossovers
from strata.kernels.cpu.crossovers import SMALL_BATCH_WEIGHT_ONLY
from strata.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from strata.layers.linear import PackableLinear
from strata.layers.moe import FusedMoE
from strata.layers.quantization.formats import Canonical, layouts, to_canonical
from strata.layers.quantization.gguf_experts import quantize_gguf_experts
from strata.layers.quantization.gguf_method import quantize_gguf
from strata.layers.quantization.moe_method import quantize_experts
from strata.layers.quantization.mxfp4 import mxfp4_experts
from strata.layers.quantization.stored import load_stored, local_shape
from strata.layers.quantization.weight_only import (
    QuantizedWeight,
    kernel_operands,
    pack_fp8,
    pack_weight,
    weight_only_linear,
)

logger = logging.getLogger(__name__)

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class QuantizedLinearMethod:
    """What a quantized layer computes with; it holds no parameters (those stay on the layer, by name)."""

    def __init__(self, scheme: LinearScheme, out_features: int, in_features: int, name: str = "") -> None:
        self.scheme, self.n, self.k, self.name = scheme, out_features, in_features, name
        self.weight: QuantizedWeight | None = None
        self.perm: torch.Tensor | None = None
        # rows up to which products take the small-batch kernel (measured at finish)
        self.small_rows = SMALL_BATCH_WEIGHT_ONLY

    def finish(self, layer: PackableLinear) -> None:
        """Loaded stored tensors -> the canonical weight; the stored tensors are dropped."""
        if self.weight is not None:
            return
        names = list(layouts(self.scheme, self.k))
        if self.scheme.format == FP8:
            try:
                self.weight = pack_fp8(layer.weight.data, layer.weight_scale.data)
            except ValueError as e:
                raise ConfigError(f"{self.name or 'an FP8 layer'}: {e}", param="model") from e
            for name in names:
                delattr(layer, name)
            self._choose_kernels()
            return
        stored = {name: getattr(layer, name).data for name in names}
        canonical: Canonical = to_canonical(self.scheme, stored, self.n, self.k)
        groups = canonical.scales.shape[1]
        group_size = -1 if groups == 1 else self.k // groups
        self.weight = pack_weight(canonical.q, canonical.scales, canonical.zeros, self.scheme.bits, group_size)
        self.perm = canonical.perm
        for name in names:
            delattr(layer, name)
        self._choose_kernels()

    def _choose_kernels(self) -> None:
        if cpu_kernels_apply(self.weight.packed):  # measured once (and cached) per kind and shape
            self.small_rows = crossovers.choose(kernel_operands(self.weight), self.weight.in_features)

    def apply(self, layer: PackableLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight is None:
            raise RuntimeError("a quantized layer ran before its weights were loaded and finished")
        if self.perm is not None:
            x = x[..., self.perm]
        if self.scheme.format == INT8_W8A8 and self.scheme.dynamic_activations:
            x = fake_quantize_per_token(x, 127.0, None)
        elif self.scheme.format == FP8 and self.scheme.dynamic_activations:
            x = fake_quantize_per_token(x, FP8_MAX, torch.float8_e4m3fn)
        return weight_only_linear(x, self.weight, bias, self.small_rows)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes if self.weight is not None else 0


def fake_quantize_per_token(x: torch.Tensor, qmax: float, dtype: torch.dtype | None) -> torch.Tensor:
    """x rounded as a per-token (row) quantization to int8 (dtype None) or FP8 would round it; the integer
    product then equals the float product of these values."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / qmax
    scaled = x.float() / scale
    rounded = scaled.round().clamp(-qmax, qmax) if dtype is None else scaled.to(dtype).float()
    return (rounded * scale).to(x.dtype)


def quantize_layer(layer: PackableLinear, scheme: LinearScheme, name: str) -> None:
    """Replace `layer.weight` by the tensors `scheme` stores, with loaders that shard them like the weight."""
    n, k = layer.weight.shape
    tp = layer.pc.tp_size if layer.splits_inputs else 1
    full_k = k * tp
    if scheme.act_order and tp > 1:
        raise ConfigError(f"{name}: activation-ordered groups (desc_act / actorder) cannot be split across "
                          f"tensor_parallel_size={tp} ranks along the inputs; use "
                          "tensor_parallel_size=1 or a checkpoint without activation ordering",
                          param="tensor_parallel_size")
    device = layer.weight.device
    del layer.weight
    for suffix, lay in layouts(scheme, full_k).items():
        # Zeros: rows no checkpoint tensor fills (an LM head's vocabulary padding) hold zero weights and scales.
        param = nn.Parameter(torch.zeros(local_shape(lay, n, k), dtype=lay.dtype, device=device),
                             requires_grad=False)
        param.weight_loader = functools.partial(load_stored, layer, lay, suffix)
        layer.register_parameter(suffix, param)
    layer.quant = QuantizedLinearMethod(scheme, n, k, name)


def checkpoint_module_names(name: str, stacked: Iterable[tuple[str, str, object]]) -> list[str]:
    """The checkpoint modules a (possibly fused) layer loads from: qkv_proj -> q_proj, k_proj, v_proj."""
    dotted = name + "."
    parts = [dotted.replace(fused, part) for fused, part, _ in stacked if fused in dotted and fused.endswith(".")]
    return [p.rstrip(".") for p in parts] or [name]


def quantize_linears(model: nn.Module, quant: QuantConfig | GGUFQuantConfig | MXFP4QuantConfig,
                     stacked: Iterable[tuple[str, str, object]], checkpoint_prefix: str = "") -> None:
    """Give every linear layer (and every routed expert's projections) the checkpoint stores quantized its
    scheme's tensors; ignored ones stay as they are. The config names layers as the checkpoint does: module
    names with `checkpoint_prefix` before them."""
    stacked = list(stacked)
    if isinstance(quant, MXFP4QuantConfig):
        quantize_mxfp4_experts(model, quant, checkpoint_prefix)
        return
    if isinstance(quant, GGUFQuantConfig):
        quantize_gguf(model, quant, lambda name: checkpoint_module_names(checkpoint_prefix + name, stacked))
        quantize_gguf_mxfp4_experts(model, quant, checkpoint_prefix)
        quantize_gguf_experts(model, quant, checkpoint_prefix)
        return
    counts = {"quantized": 0, "left as stored": 0}
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedMoE):
            scheme = quant.scheme_for([f"{checkpoint_prefix}{name}.{e}.{proj}" for e in range(module.num_experts)
                                       for proj in ("gate_proj", "up_proj", "down_proj")])
            if scheme is not None:
                quantize_experts(module, scheme, name)
            counts["quantized" if scheme else "left as stored"] += 3 * module.num_experts
        if isinstance(module, ParallelLMHead) and (module.tied or not quant.lm_head):
            continue  # a tied head is the embedding table; GPTQ heads are quantized only when the config says so
        if isinstance(module, PackableLinear) and isinstance(getattr(module, "weight", None), nn.Parameter):
            scheme = quant.scheme_for(checkpoint_module_names(checkpoint_prefix + name, stacked))
            if scheme is not None:
                quantize_layer(module, scheme, name)
            counts["quantized" if scheme else "left as stored"] += 1
    logger.info("%s checkpoint: %d linear layers quantized, %d left as stored", quant.method,
                counts["quantized"], counts["left as stored"])


def quantize_mxfp4_experts(model: nn.Module, quant: MXFP4QuantConfig, checkpoint_prefix: str) -> None:
    """MXFP4 checkpoints (gpt-oss) quantize the routed experts alone; every other layer is stored as it runs."""
    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, FusedMoE)]
    if not experts:
        raise ConfigError(f"quantization_config.quant_method mxfp4: strata reads MXFP4 routed experts (gpt-oss); "
                          f"{type(model).__name__} has none", param="quantization")
    for name, moe in experts:
        if quant.experts_quantized(checkpoint_prefix + name):
            mxfp4_experts(moe, name)
    logger.info("mxfp4 checkpoint: %d expert layers stored as MXFP4",
                sum(moe.quant is not None for _, moe in experts))


def quantize_gguf_mxfp4_experts(model: nn.Module, quant: GGUFQuantConfig, checkpoint_prefix: str) -> None:
    """gpt-oss GGUF files keep the routed experts in llama.cpp's MXFP4, which strata.gguf.gpt_oss repacks into the
    layout of gpt-oss's MXFP4 checkpoints: those experts run as the checkpoints' do."""
    for name, moe in model.named_modules():
        stored = quant.tensor_types.get(f"{checkpoint_prefix}{name}.gate_up_proj_blocks")
        if isinstance(moe, FusedMoE) and stored == gguf_types.MXFP4:
            mxfp4_experts(moe, name, quant.activations)


def finish_quantized(model: nn.Module) -> None:
    """After loading: unpack the stored tensors of every quantized layer (not for a shapes-only meta model)."""
    for module in model.modules():
        if isinstance(module, (PackableLinear, FusedMoE, VocabParallelEmbedding)) and module.quant is not None:
            params = list(module.parameters(recurse=False))
            if params and params[0].device.type != "meta":
                module.quant.finish(module)
