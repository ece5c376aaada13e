"""How an embedding model pools, read from its sentence-transformers files (`modules.json`, `1_Pooling/config.json`,
`2_Normalize`), and whether it allows `dimensions` (Matryoshka truncation)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.errors import ConfigError, RequestError, UnsupportedModelError

logger = logging.getLogger(__name__)

POOLING_MODES = ("mean", "cls", "last")
_ST_MODE_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED_KEYS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "cls"  # mean | cls | last
    normalize: bool = True
    # Output sizes a client may ask for with `dimensions` (Matryoshka); () when truncation is not allowed,
    # None when the model allows any size up to its hidden size.
    matryoshka_dimensions: tuple[int, ...] | None = ()

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """Refuse a `dimensions` this model was not trained to be cut to (RequestError naming the field)."""
        if dimensions is None:
            return
        if self.matryoshka_dimensions == ():
            raise RequestError("this model does not support `dimensions` (it has no Matryoshka representation: "
                               "truncated embeddings would be poor); leave `dimensions` out", param="dimensions")
        if not 1 <= dimensions <= hidden_size:
            raise RequestError(f"`dimensions` must be between 1 and the model's {hidden_size}, got {dimensions}",
                               param="dimensions")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise RequestError(f"`dimensions` {dimensions} is not one this model was trained for: "
                               f"{list(self.matryoshka_dimensions)}", param="dimensions")


def read_pooling_config(folder: str | Path, hf: Any) -> PoolingConfig:
    """The checkpoint's pooling: from `modules.json` when present, else CLS + normalize (vLLM's default for BERT)."""
    folder = Path(folder)
    matryoshka = _matryoshka(hf)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        logger.info("no modules.json (sentence-transformers) beside the checkpoint: pooling the CLS token, "
                    "normalized")
        return PoolingConfig("cls", True, matryoshka)
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ConfigError(f"{modules_file} must be a list of modules", param="model")
    types = [str(m.get("type", "")) for m in modules]
    unknown = [t for t in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unknown:
        raise UnsupportedModelError(f"sentence-transformers modules {unknown} are not supported (supported: "
                                    "Transformer, Pooling, Normalize)", param="model")
    if _POOLING not in types:
        raise UnsupportedModelError(f"{modules_file} has no Pooling module; strata serves sentence embeddings "
                                    "(one vector per input)", param="model")
    pooling_path = modules[types.index(_POOLING)].get("path", "1_Pooling")
    mode = _pooling_mode(_read_json(folder / pooling_path / "config.json"))
    return PoolingConfig(mode, _NORMALIZE in types, matryoshka)


def _pooling_mode(config: dict[str, Any]) -> str:
    unsupported = [k for k in _ST_UNSUPPORTED_KEYS if config.get(k)]
    modes = [mode for key, mode in _ST_MODE_KEYS.items() if config.get(key)]
    if unsupported or len(modes) != 1:
        raise UnsupportedModelError(f"pooling {[*modes, *unsupported]} is not supported: exactly one of "
                                    f"{', '.join(_ST_MODE_KEYS)} must be set", param="model")
    if config.get("include_prompt", True) is False:
        raise UnsupportedModelError("pooling with include_prompt=false (instruction tokens left out) is not "
                                    "supported", param="model")
    return modes[0]


def _matryoshka(hf: Any) -> tuple[int, ...] | None:
    """vLLM's rule: `matryoshka_dimensions` in config.json lists the allowed sizes, `is_matryoshka` allows any."""
    dims = hf.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return None if hf.get("is_matryoshka", False) else ()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}", param="model") from None


def resolve_runner(runner: str, convert: str, architecture: str, is_encoder: bool) -> str:
    """"generate" or "pooling" for --runner / --convert, refusing the combinations that cannot be served."""
    if convert not in ("none", "embed"):
        raise ConfigError(f"convert {convert!r} is not one of none, embed", param="convert")
    if convert == "embed":
        raise ConfigError("--convert embed (a generative checkpoint served as an embedding model, e.g. "
                          "Qwen3-Embedding) is not supported yet; serve an encoder checkpoint such as BertModel "
                          "with --runner pooling", param="convert")
    if runner == "auto":
        return "pooling" if is_encoder else "generate"
    if runner == "pooling" and not is_encoder:
        raise ConfigError(f"--runner pooling needs an encoder architecture (BertModel); {architecture} is a "
                          "generative model, and converting it (--convert embed) is not supported yet",
                          param="runner")
    if runner == "generate" and is_encoder:
        raise ConfigError(f"{architecture} is an encoder and cannot generate text; serve it with --runner pooling "
                          "(the default for it) and call /v1/embeddings", param="runner")
    if runner not in ("generate", "pooling"):
        raise ConfigError(f"runner {runner!r} is not one of auto, generate, pooling", param="runner")
    return runner
