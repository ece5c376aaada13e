"""llm-compressor's own environment (it pins another transformers than strata's), run by subprocess."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent
LLMC_PYTHON = os.environ.get("STRATA_LLMC_PYTHON", str(HERE.parents[2] / ".ci-llmc" / "bin" / "python"))
# Greedy comparisons with an oracle: 6 prompts x 32 tokens.
PROMPTS = [[0, 5, 9, 13], [0, 100, 200], [0, 7, 7, 7, 7, 30], [0, 250], [0, 42, 43, 44, 45, 46, 47, 48],
           [0, 300, 12, 1]]
MAX_TOKENS = 32


def llmc_python() -> str:
    """The environment's interpreter; a test needing it fails in CI without it and is skipped elsewhere."""
    if not Path(LLMC_PYTHON).is_file():
        if os.environ.get("CI"):
            pytest.fail(f"llm-compressor's environment {LLMC_PYTHON} is missing (.ci/run builds it)")
        pytest.skip(f"llm-compressor's environment {LLMC_PYTHON} is not installed (see .ci/run)")
    return LLMC_PYTHON


def relative_error(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def assert_logits_match_oracle(path, expected: dict) -> None:
    """strata's logits along the oracle's greedy tokens are within 1e-3 (relative) of the oracle's own."""
    from model_forward import strata_logits

    for prompt, tokens, logits in zip(PROMPTS, expected["tokens"], expected["logits"], strict=True):
        assert relative_error(strata_logits(path, prompt + tokens), logits) < 1e-3


def one_rank_runner(path):
    """The model runner of a single CPU rank in float32 (to look at the layers it loaded)."""
    import torch

    from strata.config import EngineConfig
    from strata.distributed import ParallelContext
    from strata.executor.model_runner import ModelRunner

    return ModelRunner(EngineConfig.create(str(path), dtype="float32", device="cpu"), ParallelContext(),
                       torch.device("cpu"))
