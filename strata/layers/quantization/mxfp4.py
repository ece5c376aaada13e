"""MXFP4 weights as gpt-oss checkpoints store them (`quantization_config.quant_method: mxfp4`): a torch dequantizer
(any device, the CUDA path) and the product `mxfp4_linear` (a C kernel for few rows on CPU,
strata/kernels/cpu/csrc/mxfp4.h).

A weight of N outputs and K = 32 * G inputs is two uint8 tensors, exactly as the checkpoint holds them:
`blocks` [N, G, 16], two e2m1 (FP4) codes a byte, low nibble first (value 2j of a block in byte j's low nibble,
2j + 1 in its high one), and `scales` [N, G], one e8m0 exponent a block: value = e2m1 * 2^(scale - 127). Experts
add a leading dimension to both ([E, N, G, 16] / [E, N, G]); one expert is `blocks[e], scales[e]`."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from strata.errors import ConfigError
from strata.kernels.cpu import abi, cpu_kernels_apply
from strata.kernels.cpu import matmul as cpu_matmul
from strata.kernels.cpu.crossovers import SMALL_BATCH_MXFP4
from strata.layers.moe import FusedMoE
from strata.layers.quantization.rounded_rows import RoundedRows

VALUES_PER_BLOCK, BYTES_PER_BLOCK = 32, 16
# e2m1: sign bit 3, then two exponent bits and one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PANEL_ROWS = 256  # weight rows dequantized at a time for many rows of x: a float32 panel stays in L2


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ConfigError unless blocks uint8 [..., N, G, 16] and scales uint8 [..., N, G] describe the same weight."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ConfigError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ConfigError(f"MXFP4 blocks must be [..., N, G, {BYTES_PER_BLOCK}] and scales [..., N, G], got "
                          f"{tuple(blocks.shape)} and {tuple(scales.shape)}")


def _half_powers_of_two(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents (uint8) as float32 2^(e - 128), built from the bits so that every one is exact (e 0 and 1 give
    subnormals) and finite: times the doubled codes they give e2m1 * 2^(e - 127) as ldexp does, e = 255 (e8m0's NaN,
    in no checkpoint) included: 0.5 * 2^128 is 2^127, and larger codes overflow to infinity, never to NaN."""
    e = scales.to(torch.int32)
    bits = torch.where(e >= 2, (e - 1) << 23, 0x00200000 << e)
    return bits.view(torch.float32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., N, G, 16] and scales [..., N, G] as values [..., N, 32 * G] in `dtype`, on blocks' device (the
    kernels' reference and the product's path off CPU). Every value is exact in float32 and bfloat16: two
    significant bits times a power of two."""
    check_mxfp4(blocks, scales)
    doubled = torch.tensor([2 * v for v in FP4_VALUES], dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).to(torch.int64)  # [..., N, G, 32]
    values = doubled[codes] * _half_powers_of_two(scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def _kernel_ready(blocks: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the C kernel can read one expert's tensors in place: whole rows of blocks (a row's bytes contiguous)
    and a contiguous exponent table."""
    n, groups = scales.shape
    return (blocks.stride(2) == 1 and blocks.stride(1) == BYTES_PER_BLOCK and scales.is_contiguous()
            and (n <= 1 or blocks.stride(0) >= groups * BYTES_PER_BLOCK))


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 activations: str = "float") -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) times one MXFP4 weight (blocks [N, K / 32, 16], scales [N, K / 32]) transposed,
    + bias [N]: [..., N] in x's dtype. On CPU up to SMALL_BATCH_MXFP4 rows of x run the C kernel (rows read once, values
    decoded in registers), more rows the GEMM over float32 panels of the weight; elsewhere, or without a C compiler,
    the weight is dequantized (to x's dtype) for the call and F.linear runs. activations="int8": x rounded to Q8_0
    blocks and multiplied in integers as llama.cpp's ggml_vec_dot_mxfp4_q8_0 does (csrc/mxfp4_q8.h), any rows;
    refused with ConfigError off strata's CPU kernels."""
    check_mxfp4(blocks, scales)
    if blocks.dim() != 3:
        raise ConfigError(f"mxfp4_linear takes one weight (blocks [N, G, 16]), got {tuple(blocks.shape)}: index the "
                          "expert first")
    n, groups = scales.shape
    k = groups * VALUES_PER_BLOCK
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the MXFP4 weight expects {k}")
    if activations == "int8":
        return rounded_mxfp4(RoundedRows(x), None, blocks, scales, bias)
    if not cpu_kernels_apply(x) or not cpu_matmul.available():
        weight = dequantize(blocks, scales, x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
    rows = cpu_matmul.float_rows(x)
    if rows.shape[0] <= SMALL_BATCH_MXFP4:
        if not _kernel_ready(blocks, scales):
            blocks, scales = blocks.contiguous(), scales.contiguous()
        flat = blocks.as_strided((n, groups * BYTES_PER_BLOCK), (blocks.stride(0), 1))
        y = cpu_matmul.matmul(rows, flat, abi.KIND_MXFP4, n, scales=scales, group_size=VALUES_PER_BLOCK, bias=bias)
    else:
        y = torch.empty(rows.shape[0], n, dtype=torch.float32)
        for n0 in range(0, n, _PANEL_ROWS):
            panel = dequantize(blocks[n0:n0 + _PANEL_ROWS], scales[n0:n0 + _PANEL_ROWS])
            part = None if bias is None else bias[n0:n0 + _PANEL_ROWS].to(torch.float32)
            y[:, n0:n0 + _PANEL_ROWS] = F.linear(rows, panel, part)
    return cpu_matmul.like_rows(y, x)


def rounded_mxfp4(x: RoundedRows, tokens: torch.Tensor | None, blocks: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `tokens` (all when None) of x rounded to Q8_0 times one MXFP4 weight (blocks [N, G, 16], scales [N, G])
    transposed, + bias: [rows, N] in x's dtype."""
    n, groups = scales.shape
    if x.k != groups * VALUES_PER_BLOCK:
        raise ValueError(f"input has {x.k} features, the MXFP4 weight expects {groups * VALUES_PER_BLOCK}")
    if not _kernel_ready(blocks, scales):
        blocks, scales = blocks.contiguous(), scales.contiguous()
    flat = blocks.as_strided((n, groups * BYTES_PER_BLOCK), (blocks.stride(0), 1))
    return x.product(tokens, flat, abi.KIND_MXFP4, VALUES_PER_BLOCK, n, exps=scales, bias=bias)


class MXFP4ExpertsMethod:
    """A `FusedMoE`'s experts run from the checkpoint's own MXFP4 tensors, this rank's share: gate_up blocks
    [E, 2I/tp, H/32, 16] and scales [E, 2I/tp, H/32] (gate rows, then up rows: the model de-interleaves the
    checkpoint's alternating rows before they arrive), down blocks [E, H, I/tp/32, 16] and scales [E, H, I/tp/32]
    (the inputs split across ranks at whole blocks). Nothing is repacked: the kernel reads them as stored.
    `activations` "int8": x rounded to Q8_0 as llama.cpp does, each token's row once a step for all its experts."""

    def __init__(self, activations: str = "float") -> None:
        self.activations = activations
        self.experts: list[tuple[torch.Tensor, ...]] = []  # per expert: gate_up blocks, scales, down blocks, scales
        self.biases: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        self.activation = None

    def stored_names(self, moe: FusedMoE) -> dict[str, dict[str, None]]:
        return {proj: {"blocks": None, "scales": None} for proj in ("gate_up_proj", "down_proj")}

    def load(self, moe: FusedMoE, proj: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """One fused checkpoint tensor of every expert, cut to this rank's rows (gate_up) or input blocks (down)."""
        e, h, i = moe.num_experts, moe.hidden_size, moe.intermediate_size
        tail = tuple(param.shape[3:])  # (16,) for blocks, () for scales
        rows, groups = (2 * i, h // VALUES_PER_BLOCK) if proj == "gate_up_proj" else (h, i // VALUES_PER_BLOCK)
        if tuple(loaded.shape) != (e, rows, groups, *tail) or loaded.dtype != torch.uint8:
            raise ValueError(f"expected uint8 {(e, rows, groups, *tail)}, checkpoint has {loaded.dtype} "
                             f"{tuple(loaded.shape)}")
        tp, rank = moe.pc.tp_size, moe.pc.tp_rank
        if proj == "gate_up_proj":
            gate, up = loaded.chunk(2, dim=1)
            local = i // tp
            loaded = torch.cat([gate.narrow(1, rank * local, local), up.narrow(1, rank * local, local)], dim=1)
        else:
            local = groups // tp
            loaded = loaded.narrow(2, rank * local, local)
        param.data.copy_(loaded)

    def finish(self, moe: FusedMoE) -> None:
        if self.experts:
            return
        tensors = [moe.gate_up_proj_blocks, moe.gate_up_proj_scales, moe.down_proj_blocks, moe.down_proj_scales]
        self.experts = [tuple(t.data[e] for t in tensors) for e in range(moe.num_experts)]
        gate_up_bias, down_bias = moe.gate_up_proj_bias, moe.down_proj_bias
        self.biases = [(None if gate_up_bias is None else gate_up_bias.data[e],
                        None if down_bias is None else down_bias.data[e]) for e in range(moe.num_experts)]
        self.activation = moe.activation

    def apply(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP on its tokens h [n, H] -> [n, H] (this rank's partial sum, biases included)."""
        gate_up_blocks, gate_up_scales, down_blocks, down_scales = self.experts[expert]
        gate_up_bias, down_bias = self.biases[expert]
        act = self.activation(mxfp4_linear(h, gate_up_blocks, gate_up_scales, gate_up_bias, self.activations))
        return mxfp4_linear(act, down_blocks, down_scales, down_bias, self.activations)

    def round_inputs(self, x: torch.Tensor) -> RoundedRows | None:
        """A step's rows x [T, H] for `apply_rounded` (rounded on first use), or None with float activations."""
        return RoundedRows(x) if self.activations == "int8" else None

    def apply_rounded(self, expert: int, x: RoundedRows, tokens: torch.Tensor) -> torch.Tensor:
        """`apply` on rows `tokens` of x, rounded once for all experts; down rounds its own input."""
        gate_up_blocks, gate_up_scales, down_blocks, down_scales = self.experts[expert]
        gate_up_bias, down_bias = self.biases[expert]
        act = self.activation(rounded_mxfp4(x, tokens, gate_up_blocks, gate_up_scales, gate_up_bias))
        return mxfp4_linear(act, down_blocks, down_scales, down_bias, "int8")

    nbytes = 0  # the stored parameters are the weights that run: FusedMoE counts those


def mxfp4_experts(moe: FusedMoE, name: str, activations: str = "float") -> None:
    """Replace a `FusedMoE`'s dense expert tensors by the MXFP4 blocks and scales the checkpoint stores
    (`activations` "int8": products with x rounded to Q8_0, as llama.cpp runs a GGUF file's MXFP4)."""
    if moe.quantized:
        raise ConfigError(f"{name}: quantization='experts_int8' cannot requantize experts the checkpoint stores as "
                          "MXFP4", param="quantization")
    e, h, i = moe.num_experts, moe.hidden_size, moe.local_intermediate
    if h % VALUES_PER_BLOCK or i % VALUES_PER_BLOCK:
        raise ConfigError(f"{name}: MXFP4 experts need the hidden size ({h}) and each rank's expert width ({i}) in "
                          f"whole blocks of {VALUES_PER_BLOCK}", param="tensor_parallel_size")
    method, device = MXFP4ExpertsMethod(activations), moe.gate_up_proj.device
    del moe.gate_up_proj, moe.down_proj
    shapes = {"gate_up_proj": (2 * i, h // VALUES_PER_BLOCK), "down_proj": (h, i // VALUES_PER_BLOCK)}
    for proj, (rows, groups) in shapes.items():
        for kind, tail in (("blocks", (BYTES_PER_BLOCK,)), ("scales", ())):
            param = torch.nn.Parameter(torch.empty((e, rows, groups, *tail), dtype=torch.uint8, device=device),
                                       requires_grad=False)
            param.weight_loader = functools.partial(method.load, moe, proj)
            moe.register_parameter(f"{proj}_{kind}", param)
    moe.quant = method
