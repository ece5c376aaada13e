"""mlx-lm's PLaMo2, the independent oracle of strata's: logits of a prompt and greedy tokens (full recompute)."""
from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

try:
    import mlx.core as mx
    import mlx_lm.models.plamo2 as mlx_plamo2
except ImportError:  # the oracle is a test-only dependency; tests that need it say so when skipped
    mx = mlx_plamo2 = None
needs_mlx = pytest.mark.skipif(mx is None, reason="mlx-lm is the PLaMo2 oracle: pip install 'mlx[cpu]' mlx-lm")


@functools.cache
def mlx_model(path: str):
    """mlx-lm's PLaMo2 on a copy of the checkpoint, with its dt clamp removed (the released model has none)."""
    from mlx_lm.utils import load_model

    original = mlx_plamo2.ssm_update
    if not isinstance(original, functools.partial):
        mlx_plamo2.ssm_update = functools.partial(original, time_step_limit=(0.0, math.inf))
    folder = f"{path}-mlx"
    shutil.copytree(path, folder, dirs_exist_ok=True)
    config = json.loads(open(f"{path}/config.json").read())
    weights = load_file(f"{path}/model.safetensors")
    if "lm_head.weight" in weights and not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = weights["lm_head.weight"][: config["vocab_size"]].contiguous()
    save_file(weights, f"{folder}/model.safetensors")
    model, _ = load_model(Path(folder))
    return model


def mlx_logits(path, ids: list[int]) -> torch.Tensor:
    out = mlx_model(str(path))(mx.array([ids]))
    return torch.from_numpy(np.array(out[0].astype(mx.float32)))


def mlx_greedy(path, ids: list[int], n: int) -> list[int]:
    tokens = list(ids)
    for _ in range(n):  # full recompute each step: no cache paths involved on the oracle's side
        tokens.append(int(mlx_logits(path, tokens)[-1].argmax()))
    return tokens[len(ids):]
