"""A model's config.json as read once: attribute access with defaults, nested `*_config` sections alike."""
from __future__ import annotations

from typing import Any


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
