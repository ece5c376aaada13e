"""Linear layers that own their tensor-parallel sharding; with tp_size=1 they are plain linears.

Each parameter has a `weight_loader(param, full_checkpoint_tensor, shard_id=None)` that keeps this
rank's slice, so the model loader never needs to know how a layer is split. On CPU the loaded weights are
re-laid out once for oneDNN (`pack_linear_weights`), whose GEMM runs 1.3-3x faster than `F.linear` here; the
few rows of a decode step read that same packed weight through a small C kernel at memory speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed import Collective, ParallelContext, StepSize, tp_collective
from strata.kernels.cpu import abi, cpu_kernels_apply
from strata.kernels.cpu import matmul as cpu_matmul
from strata.kernels.cpu.crossovers import SMALL_BATCH_DENSE, SMALL_BATCH_PLAIN
from strata.layers import onednn_weights
from strata.layers.lora import LinearLoRA
from strata.layers.onednn_weights import can_pack


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype. On CPU a few rows run a C kernel (on the packed weight, or a plain
    one such as a tied LM head's table or a bfloat16 weight), more rows oneDNN's GEMM (a plain bfloat16 weight
    where the CPU has no native bfloat16 arithmetic: strata's GEMM, which widens it in cache); elsewhere
    F.linear."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if weight.is_mkldnn:
        if 0 < rows <= SMALL_BATCH_DENSE and weight.blocked_layout is not None:
            y = onednn_weights.small_batch_linear(x.reshape(rows, -1), weight, weight.blocked_layout,
                                                  weight.out_features, bias)
            return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)  # .to: no-op for float32 / bfloat16
        return onednn_weights.onednn_linear(x, weight, bias)
    if not cpu_kernels_apply(x):
        return F.linear(x, weight.to(x.dtype), bias)
    widened = _widened(weight)
    if 0 < rows <= _small_batch_limit(widened):
        kind = cpu_matmul.dense_kind(weight)
        if kind is not None and cpu_matmul.available():
            y = cpu_matmul.matmul(cpu_matmul.float_rows(x), weight, kind, weight.shape[0], bias=bias)
            return cpu_matmul.like_rows(y, x)
    if widened:
        return widened_linear(x, weight, bias)
    if can_pack(weight) and x.dtype == weight.dtype:  # oneDNN also serves a plain weight
        return onednn_weights.gemm(x, weight, bias)
    return F.linear(x, weight.to(x.dtype), bias)


def _widened(weight: torch.Tensor) -> bool:
    """A plain bfloat16 weight where the CPU has no native bfloat16 GEMM: products widen it to float32."""
    return weight.dtype == torch.bfloat16 and not can_pack(weight)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T for many rows and a plain bfloat16 weight on a CPU without native bfloat16 arithmetic (whose own
    bfloat16 GEMM runs about 5x slower): float32 rows times the weight widened in the GEMM (without a C compiler,
    which strata.kernels.cpu.build warns about, a float32 copy of it). Returns x's dtype."""
    rows = cpu_matmul.float_rows(x)
    if not cpu_matmul.available():
        y = F.linear(rows, weight.float(), None if bias is None else bias.float())
    else:
        y = cpu_matmul.narrow_gemm(rows, weight if weight.stride(1) == 1 else weight.contiguous(), abi.KIND_BF16,
                                   weight.shape[0], bias=bias)
    return cpu_matmul.like_rows(y, x)


def small_batch_rows(weight: torch.Tensor) -> int:
    """Rows up to which a plain (not oneDNN-packed) weight goes through the small-batch C kernel."""
    return _small_batch_limit(_widened(weight))


def _small_batch_limit(widened: bool) -> int:
    return SMALL_BATCH_PLAIN if widened else SMALL_BATCH_DENSE


def pack_linear_weights(model: nn.Module) -> None:
    """After loading: every packable layer's weight re-laid out for oneDNN, quantized ones finished."""
    for module in model.modules():
        if hasattr(module, "pack_weight"):
            module.pack_weight()


class PackableLinear(nn.Module):
    """A layer whose `weight` ([out, in]) only ever goes through `linear`, so it may be packed (quantized
    layers: through their packed quantized form).

    A quantized checkpoint replaces `weight` by its stored tensors and sets `quant` (a method from
    strata.layers.quantization), which then computes the product. `out_pieces` and `in_range` say which part
    of a checkpoint tensor this rank holds, so that those tensors shard like the weight does.
    """

    weight: nn.Parameter
    quant = None
    splits_inputs = False  # row-parallel: each rank holds a slice of the inputs
    lora: LinearLoRA | None = None  # adapter slots, attached by the runner when LoRA is enabled

    def pack_weight(self) -> None:
        if self.quant is not None:
            self.quant.finish(self)
        elif can_pack(self.weight) and not getattr(self.weight, "stored_narrow", False):
            self.weight = onednn_weights.pack(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        return linear(x, self.weight, bias)

    def out_pieces(self, shard_id: object = None) -> list[tuple[int, int, int]]:
        """(offset in this rank's outputs, start in the checkpoint tensor, size) of each piece it loads."""
        return [(0, 0, self.local_shape[0])]

    def in_range(self) -> tuple[int, int]:
        """(start, size) of this rank's inputs in the checkpoint tensor."""
        return 0, self.local_shape[1]

    @property
    def local_shape(self) -> tuple[int, int]:
        """(outputs, inputs) of this rank's weight, quantized or not."""
        return (self.quant.n, self.quant.k) if self.quant is not None else tuple(self.weight.shape)


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch{(' for ' + name) if name else ''}: "
                         f"expected {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    _copy_checked(param, loaded)


def shard_dim(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's contiguous slice of `tensor` along `dim` (the full size must divide evenly)."""
    if size == 1:
        return tensor
    full = tensor.shape[dim]
    if full % size:
        raise ValueError(f"dimension {dim} of size {full} does not split into {size} shards")
    step = full // size
    return tensor.narrow(dim, rank * step, step)


class ReplicatedLinear(PackableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, default_weight_loader)
        self.bias = _param((out_features,), dtype, default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


class ColumnParallelLinear(PackableLinear):
    """Output features split across TP ranks; the output stays split unless `gather_output`."""

    def __init__(self, in_features: int, out_features: int, pc: ParallelContext, bias: bool = False,
                 gather_output: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if out_features % pc.tp_size:
            raise ValueError(f"out_features {out_features} is not divisible by tp_size {pc.tp_size}")
        self.pc, self.gather_output, self.dtype = pc, gather_output, dtype
        self.out_per_rank = out_features // pc.tp_size
        self.weight = _param((self.out_per_rank, in_features), dtype, self.weight_loader)
        self.bias = _param((self.out_per_rank,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy_checked(param, shard_dim(loaded, 0, self.pc.tp_rank, self.pc.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        if self.lora is not None:  # B's rows are this rank's outputs: the delta joins before the gather
            y = self.lora.apply(x, y)
        return self.pc.all_gather(y) if self.gather_output else y

    def out_pieces(self, shard_id: object = None) -> list[tuple[int, int, int]]:
        return [(0, self.pc.tp_rank * self.out_per_rank, self.out_per_rank)]

    def collectives(self, step: StepSize) -> list[Collective]:
        if not self.gather_output:
            return []
        return tp_collective(self.pc, "all_gather", step.num_tokens * self.out_per_rank, self.dtype)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel weights in one (e.g. gate and up); each piece is split on its own."""

    def __init__(self, in_features: int, output_sizes: list[int], pc: ParallelContext, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), pc, bias, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """One piece (shard_id i), or an already fused checkpoint tensor (None): every piece is split."""
        full = sum(self.output_sizes) if shard_id is None else self.output_sizes[shard_id]
        if loaded.shape[0] != full:
            raise ValueError(f"shape mismatch: expected {full} rows, checkpoint has {tuple(loaded.shape)}")
        for offset, start, size in self.out_pieces(shard_id):
            _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))

    def out_pieces(self, shard_id: object = None) -> list[tuple[int, int, int]]:
        tp, rank = self.pc.tp_size, self.pc.tp_rank
        local = [size // tp for size in self.output_sizes]
        pieces = [(sum(local[:i]), sum(self.output_sizes[:i]) + rank * local[i], local[i])
                  for i in range(len(local))]
        return pieces if shard_id is None else [(pieces[shard_id][0], rank * local[shard_id], local[shard_id])]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; KV heads are replicated when there are fewer of them than TP ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 pc: ParallelContext, bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        tp = pc.tp_size
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.total_q, self.total_kv = num_heads * head_dim, num_kv_heads * head_dim  # rows in the checkpoint
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, pc, bias, dtype=dtype)

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Per-rank output widths of q, k and v."""
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim, kv, kv

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """One of q, k, v (shard_id "q", "k", "v"), or a checkpoint tensor that fuses them (None, e.g. Phi-3's
        qkv_proj): each is cut out of it before it is sharded, as a contiguous split of the fused rows would mix
        q rows with k and v rows."""
        if shard_id is None and loaded.shape[0] != self.total_q + 2 * self.total_kv:
            raise ValueError(f"shape mismatch: expected {self.total_q + 2 * self.total_kv} fused q/k/v rows, "
                             f"checkpoint has {tuple(loaded.shape)}")
        for offset, start, size in self.out_pieces(shard_id):
            _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))

    def out_pieces(self, shard_id: object = None) -> list[tuple[int, int, int]]:
        q, kv, _ = self.sizes
        if shard_id is None:  # a fused checkpoint tensor: q rows, then k rows, then v rows
            (q_piece,), (k_piece,), (v_piece,) = (self.out_pieces(s) for s in ("q", "k", "v"))
            return [q_piece, (k_piece[0], self.total_q + k_piece[1], kv),
                    (v_piece[0], self.total_q + self.total_kv + v_piece[1], kv)]
        if shard_id == "q":
            return [(0, self.pc.tp_rank * q, q)]
        if shard_id in ("k", "v"):
            rank = self.pc.tp_rank // self.kv_replicas
            return [(q if shard_id == "k" else q + kv, rank * kv, kv)]
        raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split(self.sizes, dim=-1)


class RowParallelLinear(PackableLinear):
    """Input features split across TP ranks; partial outputs are summed with an all-reduce."""

    splits_inputs = True

    def __init__(self, in_features: int, out_features: int, pc: ParallelContext, bias: bool = False,
                 reduce_results: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if in_features % pc.tp_size:
            raise ValueError(f"in_features {in_features} is not divisible by tp_size {pc.tp_size}")
        self.pc, self.reduce_results = pc, reduce_results
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.weight = _param((out_features, in_features // pc.tp_size), dtype, self.weight_loader)
        self.bias = _param((out_features,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy_checked(param, shard_dim(loaded, 1, self.pc.tp_rank, self.pc.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added on one rank only, so the all-reduce counts it once.
        bias = self.bias if self.pc.tp_rank == 0 else None
        y = self.matmul(x, bias)
        if self.lora is not None:  # from this rank's inputs: the all-reduce sums the partial deltas
            y = self.lora.apply(x, y)
        return self.pc.all_reduce(y) if self.reduce_results else y

    def in_range(self) -> tuple[int, int]:
        size = self.in_features // self.pc.tp_size
        return self.pc.tp_rank * size, size

    def collectives(self, step: StepSize) -> list[Collective]:
        if not self.reduce_results:  # the caller reduces the partial sums, and reports it
            return []
        return tp_collective(self.pc, "all_reduce", step.num_tokens * self.out_features, self.dtype)
