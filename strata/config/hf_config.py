"""A model's config.json as read once: attribute access with defaults, nested `*_config` sections alike."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from strata.errors import ConfigError


class HFConfig:
    """Attribute access over a config.json dict; nested `*_config` dicts become HFConfig too."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = dict(values)

    def __getattr__(self, name: str) -> Any:
        try:
            value = self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None
        return HFConfig(value) if isinstance(value, dict) and name.endswith("_config") else value

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in self._values else default

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


def read_config_json(path: str | Path) -> HFConfig:
    """A checkpoint's config.json; a file that is not a JSON object is a ConfigError naming it, and where JSON
    parsing stopped (line and column), in one line."""
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; fix the file "
                          "(or copy it again from the model's repo)", param="model") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: it is not UTF-8 text ({e.reason} at byte {e.start})",
                          param="model") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} holds a JSON {type(values).__name__}, not an object ({{...}}) of settings",
                          param="model")
    return HFConfig(values)


def apply_hf_overrides(config: HFConfig, overrides: dict[str, Any] | None) -> HFConfig:
    """vLLM's `hf_overrides`: keys merged into the config before anything reads it (a dict given for a nested
    `*_config` section updates that section's keys; any other value replaces the key's)."""
    if not overrides:
        return config
    if not isinstance(overrides, dict):
        raise ConfigError(f"hf_overrides must be a JSON object of config.json keys, got {overrides!r}",
                          param="hf_overrides")
    values = config.to_dict()
    for key, value in overrides.items():
        section = values.get(key)
        values[key] = {**section, **value} if isinstance(section, dict) and isinstance(value, dict) else value
    return HFConfig(values)
