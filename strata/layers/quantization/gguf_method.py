"""Layers of a GGUF file kept in their ggml blocks: a linear layer's rows (this rank's outputs, its inputs cut at
block boundaries) and an embedding table looked up row by row; products through the GGUF kernels of
`gguf_quants`. A fused layer whose pieces the file stores in different types (Q4_K_M's q/k in Q4_K, v in Q6_K)
keeps one weight per piece. With int8 activations, on builds that have it, each product weight is laid out once in
the int8 kernels' tiles instead (a tied LM head: a copy beside the table's blocks, which lookups read)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from strata.config.quant_config import GGUFQuantConfig
from strata.gguf import types
from strata.gguf.weights import GGUFTensor
from strata.host_memory import huge_page_zeros
from strata.kernels.cpu import abi, cpu_kernels_apply, crossovers
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from strata.layers.linear import PackableLinear
from strata.layers.quantization import gguf_quants

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockWeight:
    """Rows [offset, offset + rows) of a layer's outputs as ggml blocks: data uint8 [rows, row_bytes]; or, with
    `tiled_rows`, those rows laid out once for the int8 kernels' tiles: data uint8 [ceil(rows / 16), strip bytes]."""

    offset: int
    data: torch.Tensor
    ggml_type: int
    tiled_rows: int = 0

    @property
    def rows(self) -> int:
        return self.tiled_rows or self.data.shape[0]

    def kernel_kind(self, activations: str) -> int:
        """The C kernels' kind for this weight's products (abi.KIND_GGUF_Q8T + ggml's type when tiled)."""
        if self.tiled_rows:
            return abi.KIND_GGUF_Q8T + self.ggml_type
        return gguf_quants.kernel_kind(self.ggml_type, activations)


class GGUFMethod:
    """What a GGUF-stored layer computes with. Loading collects this rank's rows of each checkpoint tensor;
    `finish` joins pieces of one type into one weight (padding rows past the vocabulary stay zero blocks, which
    are zero values in every type)."""

    def __init__(self, layer: nn.Module, name: str, activations: str = "float") -> None:
        self.name = name
        self.activations = activations  # "int8": x rounded to Q8_0 / Q8_K blocks per product (gguf_q8.h)
        self.n, self.k = _local_shape(layer)
        self.is_table = _is_table(layer)  # an embedding's table: looked up by row, so kept in its blocks
        self.tied_head = False  # the table is also the LM head's weight (quantize_gguf says)
        self.loaded: list[BlockWeight] = []
        self.weights: list[BlockWeight] | None = None  # what products read
        self.table: list[BlockWeight] | None = None  # a table's blocks, for lookups
        self.small_rows: dict[int, int] = {}  # ggml type -> rows up to which it takes the small-batch kernel

    def load(self, layer: nn.Module, tensor: object, shard_id: object = None) -> None:
        if not isinstance(tensor, GGUFTensor):
            raise ValueError("expected a GGUF tensor in ggml blocks")
        block = types.check_type(tensor.ggml_type, self.name)
        start, size = _in_range(layer)
        if start % block.values_per_block or size % block.values_per_block:
            raise ValueError(f"inputs {start}..{start + size} of this rank cut a {block.name} block of "
                             f"{block.values_per_block} values")
        first = start // block.values_per_block * block.bytes_per_block
        width = size // block.values_per_block * block.bytes_per_block
        data = tensor.data.reshape(-1, tensor.row_bytes)
        if self.activations == "int8":
            gguf_quants.check_int8_type(tensor.ggml_type, self.name)
        for offset, row, rows in _out_pieces(layer, shard_id):
            self.loaded.append(BlockWeight(offset, data[row:row + rows, first:first + width], tensor.ggml_type))

    def finish(self, layer: nn.Module) -> None:
        if self.weights is not None:
            return
        pieces = sorted(self.loaded, key=lambda p: p.offset)
        if len({p.ggml_type for p in pieces}) == 1:
            kind = pieces[0].ggml_type
            data = huge_page_zeros(self.n, types.row_bytes(kind, self.k))
            for p in pieces:
                data[p.offset:p.offset + p.rows] = p.data
            pieces = [BlockWeight(0, data, kind)]
        else:
            pieces = [BlockWeight(p.offset, p.data.contiguous(), p.ggml_type) for p in pieces]
            if sum(p.rows for p in pieces) != self.n:
                raise ValueError(f"{self.name}: the pieces of a fused layer stored in several types do not cover "
                                 f"its {self.n} rows")
        self.table = pieces if self.is_table else None
        if self.activations == "int8" and (not self.is_table or self.tied_head):  # a tied head: a second copy
            pieces = [_tiled(p, self.k) for p in pieces]
        self.weights, self.loaded = pieces, []
        for p in pieces:
            rows = crossovers.SMALL_BATCH_GGUF
            # measured once (and cached) per type and shape; the int8 kernels take every row count
            if self.activations == "float" and cpu_kernels_apply(p.data):
                operands = {"weight": p.data, "kind": gguf_quants.kernel_kind(p.ggml_type), "out_features": p.rows}
                rows = crossovers.choose(operands, self.k)
            self.small_rows[p.ggml_type] = rows

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weights = self._ready()
        if len(weights) == 1:
            return self._product(weights[0], x, bias)
        out = torch.cat([self._product(w, x, None) for w in weights], dim=-1)
        return out if bias is None else out + bias.to(out.dtype)

    def _product(self, w: BlockWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if w.tiled_rows:
            return gguf_quants.tiled_linear(x, w.data, w.ggml_type, self.k, w.rows, bias)
        return gguf_quants.gguf_linear(x, w.data, w.ggml_type, self.k, bias, self.small_rows[w.ggml_type],
                                       self.activations)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (local to this rank's vocabulary slice) of an embedding table, float32."""
        w = self.table_blocks()
        rows = gguf_quants.embedding_rows(w.data, w.ggml_type, self.k, ids.reshape(-1))
        return rows.view(*ids.shape, self.k)

    def table_blocks(self) -> BlockWeight:
        """An embedding table's blocks, which lookups read (a tied head's products may read a tiled copy)."""
        self._ready()
        if self.table is None:
            raise RuntimeError(f"{self.name}: not an embedding table")
        [w] = self.table
        return w

    def _ready(self) -> list[BlockWeight]:
        if self.weights is None:
            raise RuntimeError(f"{self.name}: a GGUF layer ran before its weights were loaded and finished")
        return self.weights

    @property
    def nbytes(self) -> int:
        held = list(self.weights or self.loaded)
        if self.table is not None and self.table is not self.weights:  # a tied head's second copy beside it
            held += self.table
        return sum(p.data.nbytes for p in held)


def _tiled(p: BlockWeight, k: int) -> BlockWeight:
    """A piece in the int8 kernels' tile layout (made once, its blocks then freed), or as it is where this build
    has no kernels for that layout (AVX2 and AVX-512 builds have) or its type none."""
    if not cpu_kernels_apply(p.data) or not cpu_matmul.available():
        return p
    tiles = cpu_matmul.tile_for_int8(p.data, gguf_quants.kernel_kind(p.ggml_type), k)
    return p if tiles is None else BlockWeight(p.offset, tiles, p.ggml_type, tiled_rows=p.rows)


def _is_table(layer: nn.Module) -> bool:
    """An embedding table (looked up row by row, so kept in its blocks), not a product's weight."""
    return isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)


def _local_shape(layer: nn.Module) -> tuple[int, int]:
    if isinstance(layer, VocabParallelEmbedding):
        return layer.rows_per_rank, layer.hidden_size
    return tuple(layer.weight.shape)


def _out_pieces(layer: nn.Module, shard_id: object) -> list[tuple[int, int, int]]:
    if isinstance(layer, ParallelLMHead) or not isinstance(layer, PackableLinear):  # embeddings: a vocabulary slice
        return [(0, layer.start, max(0, min(layer.rows_per_rank, layer.vocab_size - layer.start)))]
    return layer.out_pieces(shard_id)


def _in_range(layer: nn.Module) -> tuple[int, int]:
    if isinstance(layer, PackableLinear) and not isinstance(layer, ParallelLMHead):
        return layer.in_range()
    return 0, layer.hidden_size


def _block_param(method: GGUFMethod, layer: nn.Module) -> nn.Parameter:
    """The placeholder the loader finds under the layer's weight name; its loader hands the blocks to the method."""
    param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=layer.weight.device), requires_grad=False)
    param.weight_loader = lambda p, tensor, shard_id=None: method.load(layer, tensor, shard_id)
    return param


def quantize_gguf(model: nn.Module, quant: GGUFQuantConfig, checkpoint_modules) -> None:
    """Give every layer whose checkpoint tensors the file keeps in blocks a `GGUFMethod`; the embedding's table
    too, and a tied LM head reads that same table. `checkpoint_modules(name)` lists the checkpoint modules a
    (possibly fused) layer loads from."""
    counts = {"in blocks": 0, "float": 0}
    for name, module in list(model.named_modules()):
        is_table = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
        if not (is_table or isinstance(module, PackableLinear)) or not isinstance(module.weight, nn.Parameter):
            continue
        if isinstance(module, ParallelLMHead) and module.tied:
            continue  # the table's method, given below
        if not quant.types_of(checkpoint_modules(name)):
            counts["float"] += 1
            continue
        method = GGUFMethod(module, name, quant.activations)
        module.weight = _block_param(method, module)
        module.quant = method
        counts["in blocks"] += 1
        if is_table:
            for head in model.modules():
                if isinstance(head, ParallelLMHead) and head.tied:
                    head.weight, head.quant, method.tied_head = module.weight, method, True
    logger.info("GGUF checkpoint: %d layers kept in ggml blocks, %d in float32", counts["in blocks"],
                counts["float"])
    if quant.activations == "int8":
        logger.info("int8 activations (%s kernels) for every GGUF product (routed experts and MXFP4 experts too), "
                    "decode (also in the fused CPU decode path) and prefill", cpu_matmul.int8_activations_set())
