"""BERT encoders (`BertModel`: bge, e5, all-MiniLM; `BertForSequenceClassification`: ms-marco cross-encoders):
post-norm layers, bidirectional attention, no KV cache.

Tokens of a batch are packed flat: linears see only real tokens, and attention reads each sequence's rows in place
(strata.layers.encoder_attention). Heads and the MLP are sharded over TP ranks as the decoders' are."""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.layers.embedding import VocabParallelEmbedding
from strata.layers.encoder_attention import packed_attention
from strata.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from strata.layers.linear_epilogue import activated_linear, residual_linear
from strata.models import loader

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# Checkpoint tensors an encoder does not use: heads of pretraining checkpoints and cached position-id / token-type
# buffers. BertModel's pooler is ignored too (sentence-transformers pools the hidden states itself).
_IGNORED_NAMES = ("embeddings.position_ids", "embeddings.token_type_ids")


@dataclass(frozen=True)
class BertArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int = 0

    @classmethod
    def from_hf(cls, hf: Any) -> BertArgs:
        """From a config.json; position schemes and activations other than BERT's own are refused."""
        position = hf.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise UnsupportedModelError(f"BERT with position_embedding_type={position!r} is not supported "
                                        "(only 'absolute')", param="position_embedding_type")
        act = hf.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"BERT hidden_act {act!r} is not supported (supported: "
                                        f"{', '.join(_ACTIVATIONS)})", param="hidden_act")
        if hf.get("is_decoder", False) or hf.get("add_cross_attention", False):
            raise UnsupportedModelError("BERT used as a decoder (is_decoder / add_cross_attention) is not "
                                        "supported; strata serves BertModel as an encoder", param="is_decoder")
        return cls(hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
                   hf.intermediate_size, hf.get("max_position_embeddings", 512), hf.get("type_vocab_size", 2),
                   hf.get("layer_norm_eps", 1e-12), act, hf.get("pad_token_id", 0) or 0)


@dataclass(frozen=True)
class PackedBatch:
    """Sequences packed flat: `input_ids`/`positions`/`token_type_ids` [T]; `seq_lens` [B]; `pad_index` [T], each
    token's place in a [B * max_len] grid (attention's padded layout); `key_mask` [B, 1, 1, max_len]."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_type_ids: torch.Tensor
    seq_lens: torch.Tensor
    pad_index: torch.Tensor
    key_mask: torch.Tensor
    max_len: int

    @property
    def first_tokens(self) -> torch.Tensor:
        """[B] each sequence's first token (CLS) in the packed layout."""
        return torch.cumsum(self.seq_lens, 0) - self.seq_lens

    @functools.cached_property
    def seq_starts(self) -> torch.Tensor:
        """[B + 1] int64 on the CPU: where each sequence starts in the packed layout, then the token count."""
        return F.pad(torch.cumsum(self.seq_lens.cpu(), 0), (1, 0))

    @property
    def rows(self) -> torch.Tensor:
        """[T] the sequence each packed token belongs to."""
        return torch.div(self.pad_index, self.max_len, rounding_mode="floor")

    @classmethod
    def build(cls, sequences: list[list[int]], device: torch.device | str = "cpu",
              token_types: list[list[int]] | None = None) -> PackedBatch:
        """`token_types`: segment ids of pair-encoded inputs (cross-encoders); all 0 when None."""
        lens = [len(s) for s in sequences]
        max_len = max(lens)
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lens])
        types = (torch.tensor([t for s in token_types for t in s], dtype=torch.long) if token_types
                 else torch.zeros_like(ids))
        rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        pad_index = rows * max_len + positions
        key_mask = (torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None]).view(len(lens), 1, 1, max_len)
        return cls(ids.to(device), positions.to(device), types.to(device), torch.tensor(lens, device=device),
                   pad_index.to(device), key_mask.to(device), max_len)


class _Replicated(nn.Module):
    """A parameter every rank holds whole (position and token-type tables, LayerNorms)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class BertEmbeddings(nn.Module):
    def __init__(self, args: BertArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(args.vocab_size, args.hidden_size, pc, dtype)
        self.position_embeddings = _Replicated((args.max_positions, args.hidden_size), dtype)
        self.token_type_embeddings = _Replicated((args.type_vocab_size, args.hidden_size), dtype)
        self.LayerNorm = LayerNorm(args.hidden_size, args.layer_norm_eps, dtype)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = (self.word_embeddings(batch.input_ids) + F.embedding(batch.positions, self.position_embeddings.weight)
             + F.embedding(batch.token_type_ids, self.token_type_embeddings.weight))
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    def __init__(self, args: BertArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        h = args.hidden_size
        self.head_dim = h // args.num_heads
        self.qkv = QKVParallelLinear(h, self.head_dim, args.num_heads, args.num_heads, pc, bias=True, dtype=dtype)
        self.attn_out = RowParallelLinear(h, h, pc, bias=True, dtype=dtype)
        self.attn_norm = LayerNorm(h, args.layer_norm_eps, dtype)
        self.intermediate = ColumnParallelLinear(h, args.intermediate_size, pc, bias=True, dtype=dtype)
        self.output = RowParallelLinear(args.intermediate_size, h, pc, bias=True, dtype=dtype)
        self.out_norm = LayerNorm(h, args.layer_norm_eps, dtype)
        self.hidden_act = args.hidden_act
        self.act = _ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        x = self.attn_norm(residual_linear(self.attn_out, self._attend(x, batch), x))
        hidden = activated_linear(self.intermediate, x, self.hidden_act, self.act)
        return self.out_norm(residual_linear(self.output, hidden, x))

    def _attend(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        q, k, v = self.qkv.split_qkv(self.qkv(x))
        return packed_attention(q, k, v, self.qkv.num_heads, batch.seq_starts, batch.pad_index, batch.key_mask,
                                batch.max_len)


class BertModel(nn.Module):
    """The encoder: forward(batch) -> last hidden states [T, hidden] of the packed tokens."""

    # (strata parameter part, checkpoint part, shard id)
    stacked_params = [("qkv.", "attention.self.query.", "q"), ("qkv.", "attention.self.key.", "k"),
                      ("qkv.", "attention.self.value.", "v")]
    embeddings_class: type[nn.Module] = BertEmbeddings
    ignored_prefixes: tuple[str, ...] = ("pooler.", "cls.")
    _RENAMES = (("attention.output.dense.", "attn_out."), ("attention.output.LayerNorm.", "attn_norm."),
                ("intermediate.dense.", "intermediate."), ("output.dense.", "output."),
                ("output.LayerNorm.", "out_norm."))

    def __init__(self, hf: Any, pc: ParallelContext, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args, self.pc, self.dtype = BertArgs.from_hf(hf), pc, dtype
        if self.args.hidden_size % self.args.num_heads:
            raise UnsupportedModelError(f"hidden_size {self.args.hidden_size} is not a multiple of "
                                        f"num_attention_heads {self.args.num_heads}", param="num_attention_heads")
        self.embeddings = self.embeddings_class(self.args, pc, dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(self.args, pc, dtype) for _ in range(self.args.num_layers))

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def max_positions(self) -> int:
        return self.args.max_positions

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = self.embeddings(batch)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def rename_weight(self, name: str) -> str | None:
        """A checkpoint name as this module names it; None for the tensors embeddings do not use."""
        name = name.removeprefix("bert.").removeprefix("roberta.").removeprefix("model.")
        if name.startswith(self.ignored_prefixes) or name in _IGNORED_NAMES:
            return None
        if name.startswith("encoder.layer."):
            for old, new in self._RENAMES:
                if old in name:
                    return name.replace(old, new, 1)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader.load_weights(self, weights, self.stacked_params, self.rename_weight)


def num_labels(hf: Any) -> int:
    """A sequence classifier's outputs: `id2label`'s size (transformers writes it), else `num_labels`."""
    labels = hf.get("id2label") or {}
    count = len(labels) or int(hf.get("num_labels", 2))
    if count < 1:
        raise UnsupportedModelError(f"a sequence classifier needs at least one label, got {count}", param="id2label")
    return count


class BertForSequenceClassification(BertModel):
    """A cross-encoder: BERT's pooler (dense + tanh over the CLS token), then a linear classifier. The heads are
    small and replicated on every rank; the encoder's hidden states are whole after its row-parallel layers."""

    ignored_prefixes = ("cls.",)

    def __init__(self, hf: Any, pc: ParallelContext, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hf, pc, dtype)
        h, self.num_labels = self.args.hidden_size, num_labels(hf)
        self.pooler = nn.Module()
        self.pooler.dense = ReplicatedLinear(h, h, bias=True, dtype=dtype)
        self.classifier = ReplicatedLinear(h, self.num_labels, bias=True, dtype=dtype)

    def classify(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """[T, hidden] packed hidden states -> [B, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler.dense(hidden[batch.first_tokens])))
