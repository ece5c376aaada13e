"""Loading the stored tensors of a quantized layer: the local shape of each and this rank's part of a checkpoint
tensor, cut along the outputs and inputs that its `TensorLayout` names (packed, grouped or whole)."""
from __future__ import annotations

from typing import Protocol

import torch

from strata.layers.linear import _copy_checked
from strata.layers.quantization.formats import TensorLayout


class ShardedLayer(Protocol):
    """What a layer tells the loader about its part of a checkpoint tensor (see `PackableLinear`)."""

    def out_pieces(self, shard_id: object = None) -> list[tuple[int, int, int]]: ...

    def in_range(self) -> tuple[int, int]: ...


def local_shape(lay: TensorLayout, n: int, k: int) -> tuple[int, ...]:
    """The shape of a stored tensor on a rank whose part of the layer has n outputs and k inputs."""
    if lay.out_dim is None:
        return (2,) if lay.in_dim is None else (k // lay.in_div,)
    shape = [1, 1]
    shape[lay.out_dim] = n // lay.out_div
    if lay.in_dim is not None:
        shape[lay.in_dim] = k // lay.in_div
    return tuple(shape)


def narrow(t: torch.Tensor, dim: int, start: int, size: int, div: int, what: str) -> torch.Tensor:
    if start % div or size % div:
        raise ValueError(f"{what}: rows {start}..{start + size} do not fall on whole stored elements of {div}")
    if t.dim() <= dim or t.shape[dim] < (start + size) // div:
        raise ValueError(f"{what}: expected at least {(start + size) // div} along dimension {dim}, "
                         f"checkpoint has shape {tuple(t.shape)}")
    return t.narrow(dim, start // div, size // div)


def load_stored(layer: ShardedLayer, lay: TensorLayout, suffix: str, param: torch.Tensor,
                loaded: torch.Tensor, shard_id: object = None) -> None:
    """Copy this rank's part of checkpoint tensor `loaded` (shard `shard_id` of a fused layer) into `param`."""
    if lay.out_dim is None and lay.in_dim is None:  # weight_shape: the packed tensors' shapes are checked
        if loaded.numel() != 2:
            raise ValueError(f"{suffix} must hold 2 values, has shape {tuple(loaded.shape)}")
        return
    if lay.in_dim is not None:
        start, size = layer.in_range()
        loaded = narrow(loaded, lay.in_dim, start, size, lay.in_div, suffix)
    if lay.out_dim is None:  # g_idx: the fused projections of one input must share it
        if getattr(param, "loaded_from", None) is not None and param.device.type != "meta" and \
                not torch.equal(param.data, loaded.to(param.dtype)):
            raise ValueError(f"{suffix} differs between the projections fused into one layer "
                             f"({param.loaded_from} and {shard_id})")
        _copy_checked(param, loaded, suffix)
        param.loaded_from = shard_id
        return
    for offset, start, size in _joined(layer.out_pieces(shard_id)):
        if lay.per_tensor:
            if loaded.numel() != 1:
                raise ValueError(f"{suffix}: a per-tensor scale has one value, checkpoint has {tuple(loaded.shape)}")
            param.data.narrow(0, offset, size).fill_(loaded.reshape(()).item() if loaded.device.type != "meta"
                                                     else 0)
            continue
        piece = narrow(loaded, lay.out_dim, start, size, lay.out_div, suffix)
        target = narrow(param.data, lay.out_dim, offset, size, lay.out_div, suffix)
        _copy_checked(target, piece, suffix)


def _joined(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Pieces that follow each other both here and in the checkpoint, as one: a piece narrower than a packed
    element (e.g. Mamba's dt rows) then loads whole when its neighbours come with it (always with TP=1)."""
    joined: list[tuple[int, int, int]] = []
    for offset, start, size in pieces:
        if joined and joined[-1][0] + joined[-1][2] == offset and joined[-1][1] + joined[-1][2] == start:
            joined[-1] = (joined[-1][0], joined[-1][1], joined[-1][2] + size)
        else:
            joined.append((offset, start, size))
    return joined
