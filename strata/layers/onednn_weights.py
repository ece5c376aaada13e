"""oneDNN's packed linear weights on CPU: packing, the blocked layout of a packed weight, and the small-batch C
kernel that reads that layout in place (`strata/kernels/cpu/csrc/blocked_matmul.c`), so that one copy of each weight
serves oneDNN's GEMM (prefill, batched decode) and the kernel (the few rows of a decode step)."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from strata.kernels.cpu import matmul as cpu_matmul

logger = logging.getLogger(__name__)

# oneDNN picks its blocked weight layout for a typical batch; any batch size still works with it.
PACK_BATCH_HINT = 64
_BLOCKS = (64, 32, 16, 8)  # outputs per block the kernel reads
_K_MULTIPLES = (1, 8, 16, 32, 64)


@dataclass(frozen=True)
class BlockedLayout:
    """Outputs in blocks of `block`; each block holds `k_pad` rows of inputs (bfloat16: rows in pairs)."""

    block: int
    k_pad: int


@functools.cache
def _native_bfloat16() -> bool:
    """Asked once: `linear` asks for every product on a plain bfloat16 weight, and the op costs microseconds."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.is_mkldnn or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _native_bfloat16())


def pack(weight: torch.Tensor) -> nn.Parameter:
    """`weight` ([out, in]) in oneDNN's blocked layout, with the layout the small-batch kernel reads it by
    (`blocked_layout`, None when no layout it knows reproduces oneDNN's products)."""
    param = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT),
                         requires_grad=False)
    param.out_features = weight.shape[0]
    # The packed buffer never moves: its address is read once here, not through an op on every decode step.
    param.buffer_address = torch.ops.mkldnn.data_ptr(param) if hasattr(torch.ops.mkldnn, "data_ptr") else None
    param.blocked_layout = find_layout(param, *weight.shape)
    return param


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T for large batches: oneDNN reads a plain float32 weight about 15% faster than `F.linear`."""
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def find_layout(packed: torch.Tensor, n: int, k: int) -> BlockedLayout | None:
    """The layout whose size matches the packed buffer and whose product equals oneDNN's on a random input.
    oneDNN does not publish its choice, so each candidate is checked against oneDNN itself."""
    if cpu_matmul.blocked_library() is None or packed.buffer_address is None:
        return None
    element = 2 if packed.dtype == torch.bfloat16 else 4
    nbytes = torch.ops.mkldnn._nbytes(packed)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0)).to(packed.dtype)
    want = onednn_linear(x, packed, None).float()  # rounded to bfloat16 for bfloat16 weights
    for block in _BLOCKS:
        for multiple in _K_MULTIPLES:
            k_pad = -(-k // multiple) * multiple
            if element == 2 and k_pad % 2:
                continue
            if -(-n // block) * block * k_pad * element != nbytes:
                continue
            layout = BlockedLayout(block, k_pad)
            got = small_batch_linear(x.float(), packed, layout, n, None)
            # A wrong layout is off by about the outputs' size; bfloat16 rounding by under 1% of it.
            if torch.allclose(got, want, rtol=0, atol=1e-2 * float(want.abs().max()) + 1e-6):
                return layout
    logger.debug("no known blocked layout reproduces oneDNN's packed [%d, %d] %s weight", n, k, packed.dtype)
    return None


def small_batch_linear(x: torch.Tensor, packed: torch.Tensor, layout: BlockedLayout, n: int,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] times the packed weight read in place: [M, n] in x's dtype (float32 or bfloat16; others are
    computed in float32), the math in float32."""
    rows = x if x.dtype in (torch.float32, torch.bfloat16) else x.to(torch.float32)
    return cpu_matmul.blocked_matmul(rows.contiguous(), packed.buffer_address, packed.dtype == torch.bfloat16,
                                     layout.block, layout.k_pad, n, bias)
