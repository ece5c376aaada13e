"""RMSNorm, optionally fused with the residual add as in vLLM's decoder layers; on CPU through a small C kernel (one
call instead of seven torch ops, a prefill's rows shared among the threads)."""
from __future__ import annotations

import torch
from torch import nn

from strata.kernels.cpu import cpu_kernels_apply, norm_rope
from strata.kernels.cpu.abi import DTYPE_FLAGS


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self._kernel_serves(x, residual):
            return self._kernel(x, residual)
        if residual is None and self._heads_kernel_serves(x):
            return self._heads_kernel(x)
        if residual is None:
            return self.normalize(x)
        x = x + residual
        return self.normalize(x), x

    def _kernel_serves(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (cpu_kernels_apply(x) and x.dim() == 2 and x.is_contiguous()
                and x.dtype in DTYPE_FLAGS and self.weight.dtype == x.dtype
                and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()
                                          and residual.shape == x.shape))
                and norm_rope.rms_norm_library() is not None)

    def _heads_kernel_serves(self, x: torch.Tensor) -> bool:
        """Heads [T, H, D], each contiguous (views into a qkv output): q/k norms."""
        return (cpu_kernels_apply(x) and x.dim() == 3 and x.stride(2) == 1
                and x.stride(1) == x.shape[2] and x.dtype in DTYPE_FLAGS and self.weight.dtype == x.dtype
                and norm_rope.rms_norm_library() is not None)

    def _heads_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return norm_rope.rms_norm_heads(x, self.weight, self.eps)

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None):
        return norm_rope.rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one and the product taken in float32, rounded once
    at the end (not the Llama order of rounding x first). Its own `forward`, so the C kernels (Llama's rounding, a
    plain weight) and the fused decode path, which checks for RMSNorm's forward, never take it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden_size, eps, dtype)
        nn.init.zeros_(self.weight)  # a fresh norm is the identity scale, as 1 + 0

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.normalize(x)
        x = x + residual
        return self.normalize(x), x
