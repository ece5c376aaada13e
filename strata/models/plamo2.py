"""PLaMo2 (pfnet/plamo-2): a hybrid of Mamba2-style SSM layers and sliding-window GQA attention layers, each
followed by a SwiGLU MLP, with "sandwich" RMSNorms before and after every mixer and MLP."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from strata.config import HFConfig
from strata.distributed import ParallelContext
from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf.weights import GGUFTensor
from strata.layers.attention import Attention, AttentionMetadata
from strata.layers.decoder_layer import GatedMLP
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from strata.layers.mamba.mixer import ConvWeights, MambaBatch, MambaState, ShardedColumnLinear, sharded_param
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding
from strata.models import loader
from strata.models.base import CausalLM, CheckpointNames, ModelArgs

# The checkpoint stores sandwich and final norms as offsets from these values; they are folded in at load.
NORM_OFFSETS = {"pre_mixer_norm": 1.0, "post_mixer_norm": 0.2, "pre_mlp_norm": 1.0, "post_mlp_norm": 5 ** -1.5}
# q/k norm epsilon is hard-coded in the reference implementation.
QK_NORM_EPS = 1e-6


def is_mamba(cfg: HFConfig, i: int) -> bool:
    """Layer i is a Mamba layer (else attention): every mamba_step-th layer, offset mamba_step // 2, is attention;
    with too few layers for one period, only the last one is."""
    if not cfg.get("mamba_enabled", True):
        return False
    step, num_layers = cfg.get("mamba_step", 2), cfg.num_hidden_layers
    if num_layers <= step // 2:
        return i != num_layers - 1
    return i % step != step // 2


@dataclass(frozen=True, kw_only=True)
class Plamo2Args(ModelArgs):
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # of attention and Mamba heads alike
    rope_theta: float
    window: int
    full_attention_layers: tuple[int, ...]
    mamba_layers: tuple[bool, ...]  # per layer: Mamba (else attention)
    mamba_num_heads: int
    mamba_d_state: int
    mamba_d_conv: int

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Plamo2Args:
        if cfg.get("mamba_enabled", True) and cfg.get("mamba_step", 2) < 2:
            raise UnsupportedModelError(f"PLaMo2 needs mamba_step >= 2, got {cfg.get('mamba_step')}",
                                        param="mamba_step")
        return cls(**ModelArgs.common(cfg, tied=True), intermediate_size=cfg.intermediate_size,
                   num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                   head_dim=cfg.hidden_size_per_head, rope_theta=cfg.get("rope_theta", 10000.0),
                   window=cfg.get("attention_window_size", 2048),
                   full_attention_layers=tuple(cfg.get("full_attention_idx") or ()),
                   mamba_layers=tuple(is_mamba(cfg, i) for i in range(cfg.num_hidden_layers)),
                   mamba_num_heads=cfg.mamba_num_heads, mamba_d_state=cfg.mamba_d_state,
                   mamba_d_conv=cfg.get("mamba_d_conv", 4))


# Which dimension of a linear layer's stored tensor runs along its outputs: dim 0 for a plain, FP8, int8 or
# compressed-tensors weight and its scales / zero points, dim 1 in GPTQ and AWQ; weight_shape and g_idx have none.
_OUTPUT_DIM = {"weight": 0, "weight_packed": 0, "weight_scale": 0, "weight_zero_point": 0,
               "qweight": 1, "qzeros": 1, "scales": 1}


def _output_rows(tensor: torch.Tensor, leaf: str) -> int | None:
    """The output dimension of a stored tensor, None when it has none (or is one value for the whole layer)."""
    dim = _OUTPUT_DIM.get(leaf)
    return None if dim is None or tensor.dim() <= dim or tensor.numel() == 1 else dim


def _gguf_rows(tensor: GGUFTensor, rows: torch.Tensor) -> GGUFTensor:
    """A GGUF tensor with `rows` (rows of its ggml blocks, each one output) in place of its own."""
    return GGUFTensor(rows, tensor.ggml_type, (rows.shape[0], *tensor.shape[1:]))


def _heads_first(tensor: torch.Tensor, leaf: str, heads: int, name: str) -> torch.Tensor:
    """in_proj's output rows, stored per head as [z_h | x_h], regrouped as [z of all heads ; x of all heads]; rows
    packed several outputs to an element move with their head, which needs whole elements per head."""
    if isinstance(tensor, GGUFTensor):  # one output per row of blocks: the rows move whole
        return _gguf_rows(tensor, _heads_first(tensor.data, "weight", heads, name))
    dim = _output_rows(tensor, leaf)
    if dim is None:
        return tensor
    rows = tensor.movedim(dim, 0)
    if rows.shape[0] % (2 * heads):
        raise ConfigError(f"{name}: {rows.shape[0]} stored rows do not split into z and x of {heads} heads "
                          "(a packed element would straddle two heads)", param="model")
    regrouped = rows.reshape(heads, 2, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)
    return regrouped.movedim(0, dim).contiguous()


def _split_outputs(tensor: torch.Tensor, leaf: str, sizes: list[int], name: str) -> list[torch.Tensor]:
    """A fused layer's stored tensor cut into its parts' output rows (packed rows in proportion); a tensor without
    output rows (weight_shape, g_idx, a per-tensor scale) goes whole to every part."""
    if isinstance(tensor, GGUFTensor):
        return [_gguf_rows(tensor, rows) for rows in _split_outputs(tensor.data, "weight", sizes, name)]
    dim = _output_rows(tensor, leaf)
    if dim is None:
        return [tensor] * len(sizes)
    rows, total = tensor.shape[dim], sum(sizes)
    if any(rows * size % total for size in sizes):
        raise ConfigError(f"{name}: {rows} stored rows do not split into q, k and v of {sizes} outputs "
                          "(a packed element would straddle two of them)", param="model")
    return list(tensor.split([rows * size // total for size in sizes], dim=dim))


class HybridStep(NamedTuple):
    """What a PLaMo2 layer needs of one step: attention metadata, or how sequences use their state slots."""

    attn: AttentionMetadata
    batch: MambaBatch


class Plamo2MambaMixer(nn.Module):
    """Spec 3.6: z, x = in_proj(h); x = silu(conv(x)); B, C, dt from a normed low-rank projection of x;
    y = SSM(x) + D x, gated by silu(z); out_proj(y)."""

    def __init__(self, a: Plamo2Args, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads, head_dim = a.hidden_size, a.mamba_num_heads, a.head_dim
        inner, n, eps = heads * head_dim, a.mamba_d_state, a.norm_eps
        self.dt_rank = max(64, d // 16)
        self.heads, self.head_dim, self.state_size = heads // pc.tp_size, head_dim, n
        self.in_proj = ShardedColumnLinear(d, [(inner, heads), (inner, heads)], pc, dtype)  # [z ; x] after load
        self.conv1d = ConvWeights([(inner, heads)], a.mamba_d_conv, False, pc, dtype)
        self.bcdt_proj = RowParallelLinear(inner, 2 * n + self.dt_rank, pc, dtype=dtype)
        self.B_norm, self.C_norm = RMSNorm(n, eps, dtype), RMSNorm(n, eps, dtype)
        self.dt_norm = RMSNorm(self.dt_rank, eps, dtype)
        self.dt_proj = ColumnParallelLinear(self.dt_rank, heads, pc, dtype=dtype)
        self.A = sharded_param([(heads, heads)], (), pc, torch.float32, transform=lambda a: -torch.exp(a.float()))
        self.D = sharded_param([(heads, heads)], (), pc, torch.float32)
        self.dt_bias = sharded_param([(heads, heads)], (), pc, torch.float32)
        self.out_proj = RowParallelLinear(inner, d, pc, dtype=dtype)
        self.state = MambaState(self.heads * head_dim, a.mamba_d_conv, self.heads, head_dim, n)

    def forward(self, h: torch.Tensor, batch: MambaBatch) -> torch.Tensor:
        t, n = h.shape[0], self.state_size
        z, x = self.in_proj(h).chunk(2, dim=-1)
        x = self.state.conv(x, self.conv1d.weight, None, batch)
        b, c, dt = self.bcdt_proj(x).split([n, n, self.dt_rank], dim=-1)
        b, c, dt = self.B_norm(b), self.C_norm(c), self.dt_proj(self.dt_norm(dt))
        y = self.state.scan(x.view(t, self.heads, self.head_dim), dt, self.A, b.unsqueeze(1), c.unsqueeze(1),
                            self.D, z.view(t, self.heads, self.head_dim), self.dt_bias, batch)
        return self.out_proj(y.view(t, -1))


class HeadRMSNorm(nn.Module):
    """Per-head RMSNorm with one weight row per head ([heads, head_dim]), heads sharded like their projection."""

    def __init__(self, num_heads: int, head_dim: int, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = sharded_param([(num_heads, num_heads)], (head_dim,), pc, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + QK_NORM_EPS)
        return self.weight * x32.to(x.dtype)


class Plamo2AttentionMixer(nn.Module):
    """GQA attention with per-head q/k RMSNorm before NeoX RoPE (theta 10000) and a sliding window of W + 1 keys."""

    def __init__(self, a: Plamo2Args, pc: ParallelContext, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        heads, kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.qkv_proj = QKVParallelLinear(a.hidden_size, self.head_dim, heads, kv_heads, pc, False, dtype)
        self.q_norm = HeadRMSNorm(heads, self.head_dim, pc, dtype)
        self.k_norm = HeadRMSNorm(kv_heads, self.head_dim, pc, dtype)
        self.o_proj = RowParallelLinear(heads * self.head_dim, a.hidden_size, pc, dtype=dtype)
        self.rotary = RotaryEmbedding(self.head_dim, a.rope_theta)
        # The reference lets token i see keys i-W..i, i.e. W + 1 of them.
        window = None if layer in a.full_attention_layers else a.window + 1
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, sliding_window=window)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(h))
        q = self.q_norm(q.view(t, -1, self.head_dim))
        k = self.k_norm(k.view(t, -1, self.head_dim))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(t, -1, self.head_dim), meta))


class Plamo2DecoderLayer(nn.Module):
    """h += post_mixer(mixer(pre_mixer(h))); h += post_mlp(mlp(pre_mlp(h))), with the residual add fused into
    the next pre-norm (the layer returns (post_mlp output, residual))."""

    def __init__(self, a: Plamo2Args, pc: ParallelContext, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.is_mamba = a.mamba_layers[layer]
        if self.is_mamba:
            self.mixer = Plamo2MambaMixer(a, pc, dtype)
        else:
            self.mixer = Plamo2AttentionMixer(a, pc, dtype, layer)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, pc, dtype)
        for name in NORM_OFFSETS:
            setattr(self, name, RMSNorm(a.hidden_size, a.norm_eps, dtype))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                step: HybridStep) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.pre_mixer_norm(x)
        else:
            x, residual = self.pre_mixer_norm(x, residual)
        x = self.mixer(x, step.batch) if self.is_mamba else self.mixer(positions, x, step.attn)
        x, residual = self.pre_mlp_norm(self.post_mixer_norm(x), residual)
        return self.post_mlp_norm(self.mlp(x)), residual


class Plamo2ForCausalLM(CausalLM):
    """Layers live under `model.layers.layers.{i}`, as in the checkpoint."""

    args: Plamo2Args
    args_class = Plamo2Args
    names = CheckpointNames(layers="model.layers.layers")
    stacked_params: loader.StackedMapping = [
        (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
    ]

    def make_layer(self, index: int) -> Plamo2DecoderLayer:
        return Plamo2DecoderLayer(self.args, self.pc, self.dtype, index)

    def layer_context(self, meta: ForwardMeta) -> HybridStep:
        return HybridStep(meta.attn, meta.mamba)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.convert(weights))

    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF checkpoint tensors -> this model's names and layouts (spec 2.1)."""
        a = self.args
        heads, head_dim, kv = a.num_heads, a.head_dim, a.num_kv_heads * a.head_dim
        for name, tensor in weights:
            if loader.is_pp_missing(name, self.missing_prefixes):
                continue
            stem, _, leaf = name.rpartition(".")
            module = stem.rpartition(".")[2]
            if name.endswith(".mixer.in_proj." + leaf):  # per head [z_h | x_h] -> [z_all ; x_all]
                tensor = _heads_first(tensor, leaf, a.mamba_num_heads, name)
            elif ".mixer.qkv_proj." in name:
                pieces = _split_outputs(tensor, leaf, [heads * head_dim, kv, kv], name)
                for part, piece in zip("qkv", pieces, strict=True):
                    yield f"{stem.replace('qkv_proj', part + '_proj')}.{leaf}", piece
                continue
            elif leaf == "weight" and module in NORM_OFFSETS:
                tensor = tensor + NORM_OFFSETS[module]
            elif name == "model.norm.weight":
                tensor = tensor + 1.0
            elif name == "lm_head.weight":  # HF pads the head to a multiple of 16 rows
                tensor = (_gguf_rows(tensor, tensor.data[: a.vocab_size]) if isinstance(tensor, GGUFTensor)
                          else tensor[: a.vocab_size])
            renamed = {"A_log": "A", "B_norm_weight": "B_norm.weight", "C_norm_weight": "C_norm.weight",
                       "dt_norm_weight": "dt_norm.weight", "q_weight": "q_norm.weight", "k_weight": "k_norm.weight"}
            yield (f"{stem}.{renamed[leaf]}" if leaf in renamed else name), tensor
