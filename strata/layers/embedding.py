"""Vocabulary-parallel embedding and LM head: the vocabulary is padded to a multiple of 64 and split."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed import Collective, ParallelContext, StepSize, pad_vocab, tp_collective
from strata.layers.linear import PackableLinear, _copy_checked


class VocabParallelEmbedding(nn.Module):
    quant = None  # a table kept in blocks (GGUF): rows are looked up through it

    def __init__(self, vocab_size: int, hidden_size: int, pc: ParallelContext,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.pc, self.vocab_size, self.hidden_size, self.dtype = pc, vocab_size, hidden_size, dtype
        padded = pad_vocab(vocab_size) if pc.tp_size > 1 else vocab_size
        self.rows_per_rank = padded // pc.tp_size
        self.start = pc.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: expected {self.vocab_size} vocabulary rows, "
                             f"checkpoint has {tuple(loaded.shape)}")
        rows = loaded[self.start:self.start + self.rows_per_rank]
        param.data.zero_()  # padding rows stay zero
        _copy_checked(param.data[: rows.shape[0]], rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # .to: a table stored narrower than the activations (strata.layers.stored_dtype) is widened row by row.
        if self.pc.tp_size == 1:
            return self._rows(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = self._rows(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.pc.all_reduce(out)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.embed(ids).to(self.dtype)
        return F.embedding(ids, self.weight).to(self.dtype)

    def collectives(self, step: StepSize) -> list[Collective]:
        # Tokens enter on the first stage; a later stage holds the embedding only for a tied LM head.
        if not self.pc.is_first_stage:
            return []
        return tp_collective(self.pc, "all_reduce", step.num_tokens * self.hidden_size, self.dtype)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Projects hidden states to logits; each rank holds a vocabulary slice, the slices are gathered. An untied
    head may be stored quantized, like any linear layer (its rows are the vocabulary slice)."""

    def __init__(self, vocab_size: int, hidden_size: int, pc: ParallelContext,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(vocab_size, hidden_size, pc, dtype)
        self.tied = False

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight, self.tied = embedding.weight, True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.pc.all_gather(self.matmul(hidden, None))
        return logits[..., : self.vocab_size]  # padding columns are never sampled

    def pack_weight(self) -> None:
        """A tied head is the embedding's table, which lookups read row by row: it stays plain (no second copy);
        the kernels of `linear` read a plain weight too."""
        if not self.tied:
            super().pack_weight()

    def out_pieces(self, shard_id: object = None) -> list[tuple[int, int, int]]:
        """This rank's vocabulary rows of a checkpoint tensor; padding rows past the vocabulary load nothing."""
        return [(0, self.start, max(0, min(self.rows_per_rank, self.vocab_size - self.start)))]

    def collectives(self, step: StepSize) -> list[Collective]:
        """The gather of vocabulary shards in `compute_logits`, which runs only on rows that sample."""
        if step.num_sampled == 0:
            return []
        return tp_collective(self.pc, "all_gather", step.num_sampled * self.rows_per_rank, self.dtype)
