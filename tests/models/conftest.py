"""Checkpoints of the Llama-descended architectures and transformers' greedy outputs for them, built once per
session and shared by the tests of tests/models/."""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from arch_checkpoints import make_arch, transformers_greedy


@pytest.fixture(scope="session")
def arch_path(tmp_path_factory) -> Callable[..., Path]:
    """arch_path(name, tied=False): the checkpoint of that architecture (seed 0 untied, 1 tied)."""
    root = tmp_path_factory.mktemp("architectures")

    @functools.cache
    def build(name: str, tied: bool = False) -> Path:
        return make_arch(root / f"{name}{'_tied' if tied else ''}", name, tied=tied, seed=int(tied))

    return build


@pytest.fixture(scope="session")
def hf_outputs() -> Callable[..., list[dict]]:
    """hf_outputs(path, prompts, max_tokens): transformers' greedy tokens and log-probabilities, computed once."""

    @functools.cache
    def run(path: Path, prompts: tuple[tuple[int, ...], ...], max_tokens: int) -> list[dict]:
        return transformers_greedy(path, [list(p) for p in prompts], max_tokens)

    return run
