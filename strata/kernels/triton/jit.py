"""Triton, when installed: `jit` compiles a kernel (or leaves it a plain function without triton), and
`require_triton` is what every launcher calls first, so a missing package fails with a clear error."""
from __future__ import annotations

import os

from strata.errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are optional; importing their modules must still work
    triton = None
    tl = None


def jit(fn):
    return triton.jit(fn) if triton is not None else fn


def require_triton() -> None:
    if triton is None:
        raise ConfigError("kernels='triton' needs the triton package (pip install triton); "
                          "use kernels='torch' without it")


def interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
