"""Triton kernel tests run on CPU under the interpreter, which must be chosen before triton is imported."""
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
