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


def read_pooling_config(folder: str | Path, hf: Any, default_mode: str = "cls") -> PoolingConfig:
    """The checkpoint's pooling: from `modules.json` when present, else `default_mode` + normalize (vLLM's defaults:
    CLS for encoders such as BERT, the last token for decoders converted to embedding models)."""
    folder = Path(folder)
    matryoshka = _matryoshka(hf)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        logger.info("no modules.json (sentence-transformers) beside the checkpoint: pooling the %s token, "
                    "normalized", "CLS" if default_mode == "cls" else default_mode)
        return PoolingConfig(default_mode, True, matryoshka)
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


def resolve_runner(runner: str, convert: str, architecture: str, pooling_only: bool,
                   is_encoder: bool) -> tuple[str, str]:
    """(runner, convert) for --runner / --convert, refusing the combinations that cannot be served: "generate" or
    "pooling", and how the pooling runner serves a decoder ("embed" or "classify"; "none" for encoders and
    generation). As in vLLM, the pooling runner converts a generative architecture by its name: a
    `*ForSequenceClassification` one to a classifier (its `score` head over the last token), any other to an
    embedding model (its final hidden states pooled, last token unless its sentence-transformers config says
    otherwise, and normalized)."""
    if convert not in ("none", "embed", "classify"):
        raise ConfigError(f"convert {convert!r} is not one of none, embed, classify", param="convert")
    if runner not in ("auto", "generate", "pooling"):
        raise ConfigError(f"runner {runner!r} is not one of auto, generate, pooling", param="runner")
    if convert != "none" and runner == "generate":
        raise ConfigError(f"--convert {convert} serves the model through the pooling runner; it cannot also "
                          "generate: leave out --runner generate", param="runner")
    if runner == "generate" and pooling_only:
        raise ConfigError(f"{architecture} is an encoder or classifier and cannot generate text; serve it with "
                          "--runner pooling (the default for it) and call /v1/embeddings, /classify or /score",
                          param="runner")
    if convert == "none" and (runner == "generate" or (runner == "auto" and not pooling_only)):
        return "generate", "none"
    if is_encoder:  # an encoder's own architecture says what it serves
        if convert == "classify" and not architecture.endswith("ForSequenceClassification"):
            raise ConfigError(f"{architecture} has no classification head to serve with --convert classify; serve "
                              "a *ForSequenceClassification checkpoint (a cross-encoder)", param="convert")
        return "pooling", "none"
    if convert == "none":
        convert = "classify" if architecture.endswith("ForSequenceClassification") else "embed"
    return "pooling", convert


def check_pooling_options(runner: str, enable_lora: bool, pipeline_parallel_size: int) -> None:
    """The engine options the pooling runner refuses, before any process starts."""
    if runner != "pooling":
        return
    if enable_lora:
        raise ConfigError("enable_lora serves adapters for text generation; the pooling runner does not take "
                          "them", param="enable_lora")
    if isinstance(pipeline_parallel_size, int) and pipeline_parallel_size > 1:  # bad values: validate_parallel
        # A pooling batch is one forward pass with no decode steps to overlap: stages would idle in turn, each
        # batch paying every hand-off. TP splits each layer's work instead, and its memory as PP would.
        raise ConfigError(f"the pooling runner (embeddings, classifiers, scoring) does not support pipeline "
                          f"parallelism (pipeline_parallel_size={pipeline_parallel_size}): a batch is one forward "
                          "pass, so stages could not overlap; shard the model with tensor_parallel_size instead",
                          param="pipeline_parallel_size")


# sentence-transformers' CrossEncoder activations as its config names them (`sentence_transformers.activation_fn`).
_CROSS_ENCODER_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                              "torch.nn.modules.linear.Identity": "identity",
                              "torch.nn.modules.activation.Tanh": "tanh"}


def classify_activation(hf: Any, num_labels: int) -> str:
    """What /classify applies to a classifier's logits, as vLLM does (after transformers' losses by problem_type):
    identity for regression, sigmoid for multi-label or a single label, else softmax."""
    problem = hf.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or num_labels < 2:
        return "sigmoid"
    return "softmax"


def score_activation(hf: Any, num_labels: int) -> str:
    """What /score and /rerank apply to a cross-encoder's logit: the checkpoint's sentence-transformers
    `activation_fn` (or the older `sbert_ce_default_activation_function`), else sigmoid for a single label."""
    st = hf.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or hf.get(
        "sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid" if num_labels < 2 else "softmax"
    if name not in _CROSS_ENCODER_ACTIVATIONS:
        raise UnsupportedModelError(f"cross-encoder activation_fn {name!r} is not supported (supported: "
                                    f"{', '.join(_CROSS_ENCODER_ACTIVATIONS)})", param="model")
    return _CROSS_ENCODER_ACTIVATIONS[name]


RERANKER_OVERRIDES = ('--hf-overrides \'{"architectures": ["Qwen3ForSequenceClassification"], '
                       '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'')


def yes_no_reranker_tokens(hf: Any, architecture: str) -> tuple[str, str] | None:
    """(yes, no): the answer tokens of a decoder served as a yes/no reranker (vLLM's `classifier_from_token` of
    [false, true] with `is_original_qwen3_reranker`, scored sigmoid(logit_yes - logit_no)); None for other models
    (a decoder classifier without them reads its trained `score` head)."""
    if not hf.get("is_original_qwen3_reranker", False):
        return None
    tokens = hf.get("classifier_from_token")
    if architecture != "Qwen3ForSequenceClassification" or not (
            isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
        raise ConfigError(f"is_original_qwen3_reranker needs architectures ['Qwen3ForSequenceClassification'] and "
                          f"classifier_from_token of two tokens (false, true), e.g. {RERANKER_OVERRIDES}",
                          param="hf_overrides")
    return tokens[1], tokens[0]
