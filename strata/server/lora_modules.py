"""vLLM's `--lora-modules` entries (`name=path` or its JSON form) and the switch of the runtime adapter routes; kept
free of the engine's imports, so that the command line parses them cheaply."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

# vLLM's switch for the runtime load / unload routes, and strata's own name for it (either enables them).
RUNTIME_LORA_VARIABLES = ("STRATA_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: an adapter folder served as `name` (its card's parent: `base_model_name`,
    else the base model's first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}` (an argparse type)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r} is not valid JSON: {e}") from None
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: the JSON form takes \"name\" and \"path\" "
                                             "(strings) and optionally \"base_model_name\"")
        return LoRAModulePath(entry["name"], entry["path"], entry.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return LoRAModulePath(name, path)


def runtime_lora_updating() -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served (vLLM: "1" or "true")."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true") for v in RUNTIME_LORA_VARIABLES)
