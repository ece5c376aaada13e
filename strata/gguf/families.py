"""GGUF architectures whose metadata and tensors need more than the llama family's tables (strata.gguf.config and
strata.gguf.weights): each has a module of its own with `hf_config(gguf)`, `blocked_types(gguf)` and
`iterate(gguf, skip, meta)`; and the check that refuses metadata keys an architecture's module does not read."""
from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from types import ModuleType

from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf.reader import GGUFModel

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)$")

# general.architecture -> the module that reads it
MODULES = {"gpt-oss": "strata.gguf.gpt_oss", "mamba2": "strata.gguf.ssm", "plamo2": "strata.gguf.plamo2",
           "llama4": "strata.gguf.llama4"}


def family(architecture: str) -> ModuleType | None:
    """The module reading GGUF files of `architecture`, or None for the llama family's tables."""
    name = MODULES.get(architecture)
    return importlib.import_module(name) if name else None


def refuse_unknown_keys(gguf: GGUFModel, known: Iterable[str]) -> None:
    """Every `ARCH.*` metadata key must be one the architecture's module reads (or one that changes nothing it
    computes): a key strata would silently ignore could change what the model computes."""
    prefix = gguf.architecture + "."
    known = set(known)
    unknown = sorted(k for k in gguf.metadata if k.startswith(prefix) and k[len(prefix):] not in known)
    if unknown:
        raise UnsupportedModelError(f"{gguf.paths[0]}: GGUF metadata strata does not read for architecture "
                                    f"{gguf.architecture!r}: {', '.join(unknown)}", param="model")


def checkpoint_name(gguf_name: str, global_names: dict[str, str], layer_names: dict[str, str],
                    layer_prefix: str) -> str | None:
    """A GGUF tensor's checkpoint name by an architecture's tables: whole names first, then `blk.N.REST` as
    `{layer_prefix}.N.{layer_names[REST]}`; None for a tensor the tables do not know."""
    if gguf_name in global_names:
        return global_names[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    return f"{layer_prefix}.{match.group(1)}.{layer_names[match.group(2)]}"


def refuse_unknown_tensors(gguf: GGUFModel, unknown: Iterable[str]) -> None:
    """A tensor the architecture's reader does not map would be dropped, and the model run without it: refused."""
    unknown = sorted(unknown)
    if unknown:
        raise ConfigError(f"{gguf.paths[0]}: tensors strata does not know for GGUF architecture "
                          f"{gguf.architecture!r}: {', '.join(unknown[:10])}", param="model")
