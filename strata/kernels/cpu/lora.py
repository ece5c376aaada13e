"""Binding of LoRA's shrink and expand for a decode step's rows (csrc/lora.c): each row adds its slot's adapter
delta to a product in place. The fused decode path reaches it through its kernel table (decode_layer.kernels)."""
from __future__ import annotations

import ctypes
import functools

import torch

from strata.kernels.cpu import build
from strata.kernels.cpu.abi import I32, I64, PTR, Lora


@functools.cache
def library() -> ctypes.CDLL | None:
    return build.bind("lora", {"lora_apply": ([ctypes.POINTER(Lora), PTR, I64, PTR, PTR, I32], I32)})


def lora_apply(view: Lora, row_slots: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               threads: int | None = None) -> torch.Tensor:
    """y [rows, out] plus each row's delta scale * B (A x) of its slot (row_slots int64, -1: none), added in place;
    x [rows, in] and y contiguous float32 on the CPU."""
    rows = x.shape[0]
    if x.dtype != torch.float32 or y.dtype != torch.float32 or not x.is_contiguous() or not y.is_contiguous() \
            or tuple(x.shape) != (rows, view.in_features) or tuple(y.shape) != (rows, view.out_features) \
            or row_slots.dtype != torch.int64 or tuple(row_slots.shape) != (rows,):
        raise ValueError(f"lora_apply takes float32 x [rows, {view.in_features}], y [rows, {view.out_features}] and "
                         f"int64 slots [rows]; got {tuple(x.shape)}, {tuple(y.shape)}, {tuple(row_slots.shape)}")
    status = library().lora_apply(ctypes.byref(view), row_slots.data_ptr(), rows, x.data_ptr(), y.data_ptr(),
                                  torch.get_num_threads() if threads is None else threads)
    if status == -2:
        raise IndexError(f"a slot of {row_slots.tolist()} is past the layer's {view.slots}")
    if status:
        raise MemoryError("lora_apply could not allocate its scratch memory")
    return y
