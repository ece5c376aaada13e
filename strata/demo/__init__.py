"""The built-in demo model `strata-demo`: a toy Llama checkpoint shipped inside the package."""
from __future__ import annotations

import pathlib

from strata.errors import ConfigError

DEMO_MODEL_NAME = "strata-demo"

_CHECKPOINT_DIR = pathlib.Path(__file__).resolve().parent / "checkpoint"
_REBUILD_HINT = "rebuild it with `python -m strata.demo.train` (a few minutes on CPU)"


def demo_checkpoint_path() -> pathlib.Path:
    """Folder of the shipped demo checkpoint (config.json, model.safetensors, tokenizer files)."""
    if not (_CHECKPOINT_DIR / "config.json").is_file():
        raise ConfigError(
            f"the built-in demo checkpoint is missing from {_CHECKPOINT_DIR}; {_REBUILD_HINT}, "
            "or pass a model path to `strata serve`",
            param="model",
        )
    return _CHECKPOINT_DIR
