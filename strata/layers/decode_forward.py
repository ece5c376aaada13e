"""A single-stage model's whole decode step on CPU in one C call (`decode_forward` in
strata/kernels/cpu/csrc/decode_layer.c): the embedding lookup, every layer's blocks (FusedDecodeStack's), the final
norm, the LM head and each row's argmax.

The CPU counterpart of replaying a captured CUDA graph: at batch 1 the step's weights stream through the caches,
and every Python and torch call around the layers then runs several times slower than in a warm loop (the embedding
lookup, rotary tables and LM head wrapper cost a 250M model about 0.7 ms a step that way). Built by the CPU decode
backend (strata/executor/cpu_decode.py) with the scales and cap the model declares (ModelArgs), which CausalLM's
`embed_input_ids` and `compute_logits` apply too; taken when the stack serves the step and the ends are ones the call
reads (a float32 or bfloat16 table, RMSNorm, a head the small-batch kernels read, no tensor parallelism); anything
else keeps `forward` and `compute_logits`.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from strata.kernels.cpu import decode_layer
from strata.kernels.cpu.abi import Model
from strata.layers import decode_block
from strata.layers.decode_block import describe_linear
from strata.layers.decode_stack import FusedDecodeStack, step_description
from strata.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from strata.layers.quantization import gguf_quants
from strata.layers.quantization.gguf_method import GGUFMethod

_TABLE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class FusedDecodeForward:
    """Logits and greedy tokens of a decode step from the stack's layers and the model's embedding and LM head."""

    def __init__(self, stack: FusedDecodeStack, embedding: VocabParallelEmbedding, lm_head: ParallelLMHead,
                 embed_scale: float = 1.0, logits_divisor: float = 1.0, final_softcap: float = 0.0) -> None:
        """`embed_scale`: embeddings are multiplied by it (Granite, Gemma), `logits_divisor`: logits divided by it
        (Granite), `final_softcap`: logits then become cap * tanh(logits / cap) (Gemma 2; 0: none)."""
        self.stack, self.embedding, self.lm_head = stack, embedding, lm_head
        self.scales = embed_scale, logits_divisor, final_softcap
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
        attention, mlp, widest, _ = blocks
        model = self._model[0]
        step, _ = step_description(meta, self.stack.windows, rows, lora_slots=self.stack.lora_slots())
        need = rows * (4 * model.head.k + 2 * model.ropes * model.rope_half) + widest.scratch_floats(rows)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        if rows not in self._outputs:
            logits, argmax = torch.empty(rows, model.head.n), torch.empty(rows, dtype=torch.int64)
            self._outputs[rows] = (logits, argmax.numpy(), logits.data_ptr(), argmax.data_ptr())
        logits, argmax, logits_ptr, argmax_ptr = self._outputs[rows]
        args = (decode_layer.kernels(), attention, mlp, len(self.stack.fused), ctypes.byref(step), ctypes.byref(model),
                input_ids.data_ptr(), positions.data_ptr(), self._scratch.data_ptr(), logits_ptr, argmax_ptr)
        status = decode_layer.library().decode_forward(*args)
        if status == -3:  # a position past the rotary tables: grow them (checked before any work)
            self._bind_rope(int(positions.max()) + 1)
            status = decode_layer.library().decode_forward(*args)
        if status == -2:
            raise IndexError(f"a token id of {input_ids.tolist()} is outside the vocabulary of {model.vocab}")
        if status:
            raise MemoryError(f"the decode step could not allocate its scratch memory (status {status})")
        self.stack.served["whole step"] += 1
        self.stack.adapter_steps += self.stack.lora_slots() is not None
        return logits, argmax

    def _bind_rope(self, rows: int) -> None:
        """Point the call at rotary tables covering positions below `rows`."""
        tables = [rotary.float_tables(rows) for rotary in self.stack.rotaries]
        common = min(cos.shape[0] for cos, _ in tables)  # each grows on its own; all cover `rows`
        cos = torch.cat([cos[:common] for cos, _ in tables]) if len(tables) > 1 else tables[0][0]
        sin = torch.cat([sin[:common] for _, sin in tables]) if len(tables) > 1 else tables[0][1]
        model, keep, _ = self._model
        model.rope_cos, model.rope_sin, model.rope_rows = cos.data_ptr(), sin.data_ptr(), common
        keep["rope"] = (cos, sin)

    def _describe(self) -> tuple[Model, dict, int] | None:
        """The model's ends as the C call reads them, the tensors they point into and the most rows the head's
        kernel serves (as `compute_logits` would choose it), or None when one of them needs the modules' path."""
        head, norm = self.lm_head, self.stack.final_norm
        table = self._table()
        if norm is None or table is None or self.embedding.dtype != torch.float32 or head.pc.tp_size > 1 \
                or self.embedding.pc.tp_size > 1:
            return None
        data, kind, row_bytes = table
        norm_weight = decode_block.norm_kernel_weight(norm)
        keep: dict = {"tensors": [data, norm_weight]}
        described = describe_linear(head, None, keep["tensors"])
        if described is None or described[0].n != self.embedding.vocab_size \
                or described[0].k != self.embedding.hidden_size:
            return None
        model = Model(table=data.data_ptr(), vocab=self.embedding.vocab_size,
                       bf16=int(data.dtype == torch.bfloat16), rope_cos=None, rope_sin=None, rope_rows=0,
                       rope_half=self.stack.rotaries[0].rotary_dim // 2, ropes=len(self.stack.rotaries),
                       final_norm=norm_weight.data_ptr(),
                       final_eps=norm.eps, head=described[0], table_kind=kind, table_row_bytes=row_bytes,
                       embed_scale=self.scales[0], logits_divisor=self.scales[1], final_softcap=self.scales[2])
        return model, keep, described[1]

    def _table(self) -> tuple[torch.Tensor, int, int] | None:
        """(table, its kernel kind for rows in ggml blocks or 0 for float32 / bfloat16 rows, bytes per row)."""
        if isinstance(self.embedding.quant, GGUFMethod):
            weight = self.embedding.quant.table_blocks()
            return weight.data, gguf_quants.kernel_kind(weight.ggml_type), weight.data.stride(0)
        table = self.embedding.weight
        if self.embedding.quant is not None or table.dtype not in _TABLE_DTYPES or not table.is_contiguous() \
                or table.is_mkldnn:
            return None
        return table, 0, 0
