"""XLM-RoBERTa encoders (`XLMRobertaModel`: bge-m3, multilingual-e5; `XLMRobertaForSequenceClassification`:
bge-reranker): BERT's layers, with positions counted from after the padding id as fairseq numbers them."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed import ParallelContext
from strata.layers.linear import ReplicatedLinear
from strata.models.bert import BertEmbeddings, BertModel, PackedBatch, num_labels


class XLMRobertaEmbeddings(BertEmbeddings):
    """Position ids as transformers' `create_position_ids_from_input_ids`: each non-padding token's 1-based count
    within its sequence plus `pad_token_id`; padding tokens get `pad_token_id` itself."""

    def __init__(self, args: Any, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__(args, pc, dtype)
        self.padding_idx = args.pad_token_id

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        real = (batch.input_ids != self.padding_idx).long()
        counts = torch.cumsum(real, 0)
        before = (counts - real)[batch.first_tokens]  # tokens counted in the sequences packed earlier
        positions = (counts - before[batch.rows]) * real + self.padding_idx
        x = (self.word_embeddings(batch.input_ids) + F.embedding(positions, self.position_embeddings.weight)
             + F.embedding(batch.token_type_ids, self.token_type_embeddings.weight))
        return self.LayerNorm(x)


class XLMRobertaModel(BertModel):
    """The encoder: forward(batch) -> last hidden states [T, hidden] of the packed tokens."""

    embeddings_class = XLMRobertaEmbeddings

    @property
    def max_positions(self) -> int:
        # Positions start after the padding id: a 514-entry table holds 512 tokens.
        return self.args.max_positions - self.args.pad_token_id - 1


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """A cross-encoder: RoBERTa's classification head (dense + tanh + out_proj) on the first token (<s>)."""

    ignored_prefixes = ("pooler.", "lm_head.")

    def __init__(self, hf: Any, pc: ParallelContext, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hf, pc, dtype)
        h, self.num_labels = self.args.hidden_size, num_labels(hf)
        self.classifier = nn.Module()
        self.classifier.dense = ReplicatedLinear(h, h, bias=True, dtype=dtype)
        self.classifier.out_proj = ReplicatedLinear(h, self.num_labels, bias=True, dtype=dtype)

    def classify(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """[T, hidden] packed hidden states -> [B, num_labels] logits."""
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(hidden[batch.first_tokens])))
