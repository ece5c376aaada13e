"""Triton kernel tests run on CPU under the interpreter, which must be chosen before triton is imported
(on a machine with CUDA they compile for the GPU instead)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
