"""ModernBERT encoders (`ModernBertModel`: gte-modernbert, modernbert-embed): pre-norm layers, RoPE with one theta
for global and one for local layers, local layers attending within a window, a GeGLU MLP; no KV cache.

Tokens of a batch are packed flat as BERT's are (strata.models.bert.PackedBatch); attention alone pads them per
sequence. Heads and the MLP are sharded over TP ranks as the decoders' are."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.layers.embedding import VocabParallelEmbedding
from strata.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from strata.layers.rotary import RotaryEmbedding
from strata.models import loader
from strata.models.bert import PackedBatch

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
_GLOBAL, _LOCAL = "full_attention", "sliding_attention"
# Heads of pretraining (masked LM) checkpoints, unused by an encoder serving embeddings.
_IGNORED_PREFIXES = ("head.", "decoder.")


@dataclass(frozen=True)
class ModernBertArgs:
    vocab_size: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    norm_eps: float
    hidden_act: str
    layer_types: tuple[str, ...]  # full_attention | sliding_attention per layer
    window: int  # a local layer's token attends to keys at most this far on either side (local_attention // 2)
    global_theta: float
    local_theta: float
    attention_bias: bool
    mlp_bias: bool
    norm_bias: bool

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf(cls, hf: Any) -> ModernBertArgs:
        """From a config.json as transformers 5 writes it (`layer_types`, `rope_parameters`) or as older ones do
        (`global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`)."""
        act = hf.get("hidden_activation", "gelu")
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"ModernBERT hidden_activation {act!r} is not supported (supported: "
                                        f"{', '.join(_ACTIVATIONS)})", param="hidden_activation")
        n = hf.num_hidden_layers
        every = int(hf.get("global_attn_every_n_layers", 3))
        types = tuple(hf.get("layer_types") or [_LOCAL if i % every else _GLOBAL for i in range(n)])
        if len(types) != n or set(types) - {_GLOBAL, _LOCAL}:
            raise UnsupportedModelError(f"layer_types must name {_GLOBAL} or {_LOCAL} for each of the {n} layers, "
                                        f"got {list(types)}", param="layer_types")
        if hf.get("hidden_size") % hf.get("num_attention_heads"):
            raise UnsupportedModelError(f"hidden_size {hf.hidden_size} is not a multiple of num_attention_heads "
                                        f"{hf.num_attention_heads}", param="num_attention_heads")
        return cls(hf.vocab_size, hf.hidden_size, hf.num_attention_heads, hf.intermediate_size,
                   hf.get("max_position_embeddings", 8192), hf.get("norm_eps", 1e-5), act, types,
                   int(hf.get("local_attention", 128)) // 2, _theta(hf, _GLOBAL, "global_rope_theta", 160_000.0),
                   _theta(hf, _LOCAL, "local_rope_theta", 10_000.0), bool(hf.get("attention_bias", False)),
                   bool(hf.get("mlp_bias", False)), bool(hf.get("norm_bias", False)))


def _theta(hf: Any, layer_type: str, old_key: str, default: float) -> float:
    """A layer type's RoPE base; scaled RoPE (anything but the default kind) is refused."""
    params = (hf.get("rope_parameters") or {}).get(layer_type) or {}
    kind = params.get("rope_type", "default")
    if kind != "default" or hf.get("rope_scaling"):
        raise UnsupportedModelError(f"ModernBERT with scaled RoPE ({kind!r}) is not supported", param="rope_parameters")
    return float(params.get("rope_theta") or hf.get(old_key) or default)


class LayerNorm(nn.Module):
    """ModernBERT's LayerNorm: its bias only where `norm_bias` asks for one."""

    def __init__(self, size: int, eps: float, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class ModernBertEmbeddings(nn.Module):
    """Token embeddings and their norm (the positions are rotary, in attention)."""

    def __init__(self, args: ModernBertArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.tok_embeddings = VocabParallelEmbedding(args.vocab_size, args.hidden_size, pc, dtype)
        self.norm = LayerNorm(args.hidden_size, args.norm_eps, args.norm_bias, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, args: ModernBertArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        h = args.hidden_size
        self.head_dim = h // args.num_heads
        self.Wqkv = QKVParallelLinear(h, self.head_dim, args.num_heads, args.num_heads, pc, bias=args.attention_bias,
                                      dtype=dtype)
        self.Wo = RowParallelLinear(h, h, pc, bias=args.attention_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, batch: PackedBatch, rotary: RotaryEmbedding, mask: torch.Tensor
                ) -> torch.Tensor:
        q, k, v = self.Wqkv.split_qkv(self.Wqkv(x))
        heads, d, b = self.Wqkv.num_heads, self.head_dim, batch.seq_lens.shape[0]
        q, k = rotary(batch.positions, q.view(-1, heads, d), k.view(-1, heads, d))

        def padded(t: torch.Tensor) -> torch.Tensor:  # [T, heads*d] -> [B, heads, max_len, d]
            grid = t.new_zeros(b * batch.max_len, heads * d)
            grid[batch.pad_index] = t.reshape(-1, heads * d)
            return grid.view(b, batch.max_len, heads, d).transpose(1, 2)

        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask)
        return self.Wo(out.transpose(1, 2).reshape(b * batch.max_len, heads * d)[batch.pad_index])


class ModernBertMLP(nn.Module):
    """GeGLU: Wo(act(input) * gate), `Wi` holding the input rows, then the gate rows."""

    def __init__(self, args: ModernBertArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        size = args.intermediate_size
        self.Wi = MergedColumnParallelLinear(args.hidden_size, [size, size], pc, bias=args.mlp_bias, dtype=dtype)
        self.Wo = RowParallelLinear(size, args.hidden_size, pc, bias=args.mlp_bias, dtype=dtype)
        self.act = _ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(up) * gate)


class ModernBertLayer(nn.Module):
    """Pre-norm; the first layer has no attention norm (the embeddings' norm precedes it)."""

    def __init__(self, args: ModernBertArgs, index: int, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        h = args.hidden_size
        self.is_local = args.layer_types[index] == _LOCAL
        self.attn_norm = LayerNorm(h, args.norm_eps, args.norm_bias, dtype) if index else nn.Identity()
        self.attn = ModernBertAttention(args, pc, dtype)
        self.mlp_norm = LayerNorm(h, args.norm_eps, args.norm_bias, dtype)
        self.mlp = ModernBertMLP(args, pc, dtype)

    def forward(self, x: torch.Tensor, batch: PackedBatch, rotary: RotaryEmbedding, mask: torch.Tensor
                ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), batch, rotary, mask)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(nn.Module):
    """The encoder: forward(batch) -> last hidden states [T, hidden] of the packed tokens, after the final norm."""

    def __init__(self, hf: Any, pc: ParallelContext, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args, self.pc, self.dtype = ModernBertArgs.from_hf(hf), pc, dtype
        args = self.args
        self.embeddings = ModernBertEmbeddings(args, pc, dtype)
        self.layers = nn.ModuleList(ModernBertLayer(args, i, pc, dtype) for i in range(args.num_layers))
        self.final_norm = LayerNorm(args.hidden_size, args.norm_eps, args.norm_bias, dtype)
        head_dim = args.hidden_size // args.num_heads
        self.rotary = nn.ModuleDict({"global": RotaryEmbedding(head_dim, args.global_theta),
                                     "local": RotaryEmbedding(head_dim, args.local_theta)})

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def max_positions(self) -> int:
        return self.args.max_positions

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = self.embeddings(batch.input_ids)
        # Keys a query may see: its sequence's tokens (global layers), those within the window (local layers).
        steps = torch.arange(batch.max_len, device=x.device)
        near = (steps[:, None] - steps[None, :]).abs() <= self.args.window
        masks = {False: batch.key_mask, True: batch.key_mask & near}
        for layer in self.layers:
            rotary = self.rotary["local" if layer.is_local else "global"]
            x = layer(x, batch, rotary, masks[layer.is_local])
        return self.final_norm(x)

    @staticmethod
    def rename_weight(name: str) -> str | None:
        """A checkpoint name as this module names it (those of ModernBertModel); the masked-LM head is ignored."""
        name = name.removeprefix("model.")
        return None if name.startswith(_IGNORED_PREFIXES) else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`Wqkv` and `Wi` are fused in the checkpoint: their weight loaders cut q/k/v and input/gate out of them."""
        loader.load_weights(self, weights, (), self.rename_weight)
