"""A single-stage model's whole decode step on CPU in one C call (`decode_forward` in strata/csrc/decode_layer.c):
the embedding lookup, every layer's blocks (FusedDecodeStack's), the final norm, the LM head and each row's argmax.

The CPU counterpart of replaying a captured CUDA graph: at batch 1 the step's weights stream through the caches,
and every Python and torch call around the layers then runs several times slower than in a warm loop (the embedding
lookup, rotary tables and LM head wrapper cost a 250M model about 0.7 ms a step that way). Taken when the stack
serves the step and the model's ends are the plain ones (a float32 or bfloat16 table, RMSNorm, a head the small-batch
kernels read, no tensor parallelism); anything else keeps `forward` and `compute_logits`.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from strata.layers import decode_block
from strata.layers.decode_block import FusedDecodeStack, _Linear, describe_linear
from strata.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from strata.native import PTR

_TABLE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class _Model(ctypes.Structure):
    _fields_ = [("table", PTR), ("vocab", ctypes.c_int64), ("bf16", ctypes.c_int64), ("rope_cos", PTR),
                ("rope_sin", PTR), ("rope_rows", ctypes.c_int64), ("rope_half", ctypes.c_int64),
                ("final_norm", PTR), ("final_eps", ctypes.c_float), ("head", _Linear)]


class FusedDecodeForward:
    """Logits and greedy tokens of a decode step from the stack's layers and the model's embedding and LM head."""

    def __init__(self, stack: FusedDecodeStack, embedding: VocabParallelEmbedding, lm_head: ParallelLMHead) -> None:
        self.stack, self.embedding, self.lm_head = stack, embedding, lm_head
        self._model: tuple | None | bool = False  # False: not described yet; else (struct, tensors, head's rows)
        self._scratch = torch.empty(0)
        self._outputs: dict[int, tuple] = {}  # rows -> (logits, argmax, their addresses)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object
                 ) -> tuple[torch.Tensor, np.ndarray] | None:
        """(float32 logits [T, vocab], int64 argmax of each row), both valid until the next call, or None when the
        step takes the modules' path."""
        rows = input_ids.shape[0]
        blocks = self.stack.blocks(rows, meta)
        if blocks is None:
            return None
        if self._model is False:
            self._model = self._describe()
        if self._model is None or rows > self._model[2]:
            return None
        attention, mlp, widest = blocks
        model = self._model[0]
        attn_module = self.stack.fused[0].layer.self_attn
        step, _ = decode_block.step_description(meta, attn_module.attn, rows)
        need = rows * (4 * model.head.k + 2 * model.rope_half) + decode_block._scratch_floats(widest, rows)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        if rows not in self._outputs:
            logits, argmax = torch.empty(rows, model.head.n), torch.empty(rows, dtype=torch.int64)
            self._outputs[rows] = (logits, argmax.numpy(), logits.data_ptr(), argmax.data_ptr())
        logits, argmax, logits_ptr, argmax_ptr = self._outputs[rows]
        args = (decode_block._kernels(), attention, mlp, len(self.stack.fused), ctypes.byref(step), ctypes.byref(model),
                input_ids.data_ptr(), positions.data_ptr(), self._scratch.data_ptr(), logits_ptr, argmax_ptr)
        status = decode_block._library().decode_forward(*args)
        if status == -3:  # a position past the rotary tables: grow them (checked before any work)
            self._bind_rope(int(positions.max()) + 1)
            status = decode_block._library().decode_forward(*args)
        if status == -2:
            raise IndexError(f"a token id of {input_ids.tolist()} is outside the vocabulary of {model.vocab}")
        if status:
            raise MemoryError(f"the decode step could not allocate its scratch memory (status {status})")
        return logits, argmax

    def _bind_rope(self, rows: int) -> None:
        """Point the call at rotary tables covering positions below `rows`."""
        cos, sin = self.stack.fused[0].layer.self_attn.rotary.float_tables(rows)
        model, keep, _ = self._model
        model.rope_cos, model.rope_sin, model.rope_rows = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
        keep["rope"] = (cos, sin)

    def _describe(self) -> tuple[_Model, dict, int] | None:
        """The model's ends as the C call reads them, the tensors they point into and the most rows the head's
        kernel serves (as `compute_logits` would choose it), or None when one of them needs the modules' path."""
        table, head, norm = self.embedding.weight, self.lm_head, self.stack.final_norm
        if norm is None or table.dtype not in _TABLE_DTYPES or not table.is_contiguous() or table.is_mkldnn \
                or self.embedding.dtype != torch.float32 or head.pc.tp_size > 1 or self.embedding.pc.tp_size > 1:
            return None
        keep: dict = {"tensors": [table, norm.weight]}
        described = describe_linear(head, None, keep["tensors"])
        if described is None or described[0].n != self.embedding.vocab_size or described[0].k != table.shape[1]:
            return None
        rope = self.stack.fused[0].layer.self_attn.rotary
        model = _Model(table=table.data_ptr(), vocab=table.shape[0], bf16=_TABLE_DTYPES[table.dtype], rope_cos=None,
                       rope_sin=None, rope_rows=0, rope_half=rope.head_dim // 2, final_norm=norm.weight.data_ptr(),
                       final_eps=norm.eps, head=described[0])
        return model, keep, described[1]
