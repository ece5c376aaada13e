"""SpeculativeConfig: vLLM's `speculative_config` dict (n-gram, suffix or draft-model speculation), checked once at
start-up into a frozen config; every error names the key and how to fix it."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from strata.errors import ConfigError

METHODS = ("ngram", "suffix", "draft_model")
_PARAM = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """How draft tokens are proposed. `num_speculative_tokens` is the most drafted per step and request (for suffix
    a maximum; each proposal is as long as its match supports)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    # No drafts while this many requests or more are running (vLLM's name); None: never by count alone.
    disable_by_batch_size: int | None = None
    # Most tokens (decodes and drafts) in a step that carries drafts: past it a step stops being bound by reading
    # the weights and every draft token costs compute. None: chosen for the device (see `step_token_budget`).
    max_step_tokens: int | None = None

    def step_token_budget(self, device_type: str) -> int:
        """Tokens a step may hold with drafts: on CPU a step of about 16 tokens still costs about one decode step
        (the weights stream once, the arithmetic is small); a GPU stays bound by memory much longer."""
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return 256 if device_type == "cuda" else 16


_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "suffix_decoding_max_tree_depth",
         "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
         "model", "draft_tensor_parallel_size", "disable_by_batch_size", "max_step_tokens"}


def _error(key: str, message: str) -> ConfigError:
    return ConfigError(f"speculative_config.{key} {message}", param=f"{_PARAM}.{key}")


def _int(options: dict[str, Any], key: str, low: int, default: int | None) -> int | None:
    value = options.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _error(key, f"must be an integer >= {low}, got {value!r}")
    return value


def _float(options: dict[str, Any], key: str, low: float, high: float, default: float) -> float:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _error(key, f"must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _method(options: dict[str, Any]) -> str:
    method = options.get("method")
    model = options.get("model")
    if method is None:
        if model is None:
            raise _error("method", 'is missing: give "method": "ngram" or "suffix", or "model": a draft checkpoint')
        return "draft_model"
    if method not in METHODS:
        raise _error("method", f"{method!r} is not supported; use one of {', '.join(METHODS)} (EAGLE, MTP and "
                               "Medusa heads are not supported)")
    if method != "draft_model" and model is not None:
        raise _error("model", f"is only for draft-model speculation; drop it, or drop method {method!r}")
    if method == "draft_model" and model is None:
        raise _error("model", "is missing: draft-model speculation needs the draft checkpoint's path")
    return method


def parse_speculative_config(options: dict[str, Any] | None) -> SpeculativeConfig | None:
    """The checked config of a `speculative_config` dict (None: no speculation). Checks that need the target model
    are `check_target`'s."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ConfigError(f"speculative_config must be a JSON object (a dict), got {type(options).__name__}",
                          param=_PARAM)
    for key in options:
        if key not in _KEYS:
            close = difflib.get_close_matches(key, sorted(_KEYS), n=2)
            hint = f"did you mean {' or '.join(close)}?" if close else f"the keys are: {', '.join(sorted(_KEYS))}"
            raise _error(key, f"is not a speculative_config key; {hint}")
    method = _method(options)
    depth = _int(options, "suffix_decoding_max_tree_depth", 1, 24)
    k = _int(options, "num_speculative_tokens", 1, depth if method == "suffix" else None)
    if k is None:
        raise _error("num_speculative_tokens", f"is missing: {method} speculation needs the number of draft tokens "
                                               "per step, e.g. 4")
    low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
    low = _int(options, "prompt_lookup_min", 1, high if high is not None else 5)
    high = _int(options, "prompt_lookup_max", 1, low)
    if low > high:
        raise _error("prompt_lookup_min", f"({low}) must be <= prompt_lookup_max ({high})")
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high,
        suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_cached_requests=_int(options, "suffix_decoding_max_cached_requests", -1, 10000),
        suffix_decoding_max_spec_factor=_float(options, "suffix_decoding_max_spec_factor", 0.0, 1e6, 1.0),
        suffix_decoding_min_token_prob=_float(options, "suffix_decoding_min_token_prob", 0.0, 1.0, 0.1),
        model=options.get("model"),
        draft_tensor_parallel_size=_int(options, "draft_tensor_parallel_size", 1, 1),
        disable_by_batch_size=_int(options, "disable_by_batch_size", 1, None),
        max_step_tokens=_int(options, "max_step_tokens", 2, None))


def check_target(config: SpeculativeConfig, architecture: str, is_hybrid: bool, max_model_len: int) -> None:
    """Refuse speculation a target model cannot verify."""
    if is_hybrid:
        raise ConfigError(f"speculative decoding is not supported for {architecture}: its Mamba state cannot be "
                          "rolled back past rejected draft tokens; run it without speculative_config",
                          param=_PARAM)
    if config.num_speculative_tokens >= max_model_len:
        raise _error("num_speculative_tokens", f"({config.num_speculative_tokens}) must be below max_model_len "
                                               f"({max_model_len})")
