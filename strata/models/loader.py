"""Checkpoint loading: memory-mapped safetensors, per-parameter weight loaders, strict name checks."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from strata.config import ModelConfig
from strata.errors import ConfigError
from strata.gguf.reader import GGUFModel
from strata.gguf.weights import GGUFTensor, iterate_gguf

logger = logging.getLogger(__name__)

# (fused parameter part, checkpoint part, shard id): e.g. q_proj is shard "q" of qkv_proj.
StackedMapping = list[tuple[str, str, object]]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def checkpoint_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"checkpoint index names files that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [f.name for f in folder.iterdir() if f.suffix in _PICKLE_SUFFIXES]
        why = (f"only pickle files ({', '.join(pickled)}), which strata refuses to load because they can "
               "run arbitrary code; convert them to safetensors") if pickled else "no *.safetensors files"
        raise ConfigError(f"checkpoint {str(folder)!r} has {why}", param="model")
    return files


def iterate_weights(folder: str | Path, skip: Callable[[str], bool] = lambda name: False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time from memory-mapped files; skipped names are never read."""
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not skip(name):
                    yield name, f.get_tensor(name)


def checkpoint_weights(model: ModelConfig, skip: Callable[[str], bool] = lambda name: False, meta: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """The model's tensors under their checkpoint names, from its safetensors files or its GGUF file(s) (quantized
    GGUF tensors in their blocks); with `meta`, GGUF tensors as shapes only."""
    if model.gguf_files:
        return iterate_gguf(GGUFModel(model.gguf_files), skip, meta)
    return iterate_weights(model.path, skip)


def checkpoint_names(folder: str | Path) -> list[str]:
    names: list[str] = []
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def is_pp_missing(name: str, missing_prefixes: Iterable[str]) -> bool:
    """True for weights of modules that live on another pipeline stage (trailing dot: layers.1 != layers.11)."""
    return any(name.startswith(prefix + ".") for prefix in missing_prefixes)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 stacked: StackedMapping = (), rename: Callable[[str], str | None] = lambda n: n,
                 missing_prefixes: Iterable[str] = ()) -> None:
    """Load every checkpoint tensor through its parameter's weight_loader; refuse missing or extra ones.

    `rename` maps a checkpoint name to a parameter name, or None for tensors the model deliberately
    ignores (e.g. cached rotary tables). Names of other pipeline stages are skipped.
    """
    missing_prefixes = list(missing_prefixes)
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    unexpected: list[str] = []
    errors: list[str] = []
    for checkpoint_name, tensor in weights:
        name = rename(checkpoint_name)
        if name is None or is_pp_missing(name, missing_prefixes):
            continue
        target, shard = name, None
        for param_part, checkpoint_part, shard_id in stacked:
            if checkpoint_part in name:
                target, shard = name.replace(checkpoint_part, param_part), shard_id
                break
        param = params.get(target)
        if param is None:
            unexpected.append(checkpoint_name)
            continue
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"expected {tuple(param.shape)}, checkpoint has {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
        except ValueError as e:
            errors.append(f"{checkpoint_name}: {e}")
        loaded.setdefault(target, set()).add(shard)
    _check_complete(params, loaded, unexpected, errors, stacked, missing_prefixes)


def _check_complete(params: dict[str, nn.Parameter], loaded: dict[str, set], unexpected: list[str],
                    errors: list[str], stacked: StackedMapping, missing_prefixes: list[str]) -> None:
    shards_of: dict[str, set] = {}
    for param_part, _, shard_id in stacked:
        shards_of.setdefault(param_part, set()).add(shard_id)
    missing = []
    for name in params:
        if is_pp_missing(name, missing_prefixes):
            continue
        got = loaded.get(name)
        part = next((p for p in shards_of if p in name), None)
        expected = shards_of.get(part, {None})
        if got is None:
            missing.append(name)
        elif None not in got and not expected <= got:
            # Some pieces of a fused parameter arrived: name the checkpoint tensors that did not.
            missing += [name.replace(part, checkpoint_part) for param_part, checkpoint_part, shard_id in stacked
                        if param_part == part and shard_id not in got]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(sorted(missing)[:20])}"
                        + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected)[:20])}"
                        + (f" (+{len(unexpected) - 20} more)" if len(unexpected) > 20 else ""))
    if errors:
        problems.append("shape mismatches: " + "; ".join(errors[:10]))
    if problems:
        raise ConfigError("checkpoint does not match the model: " + " | ".join(problems), param="model")
