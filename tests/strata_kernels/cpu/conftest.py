"""Fixtures shared by the CPU kernel tests: a library rebuilt for another x86-64 level inside a test."""
from collections.abc import Callable, Iterator

import pytest

from strata.errors import ConfigError
from strata.kernels.cpu import build


@pytest.fixture
def x86_64_v3(monkeypatch) -> Iterator[Callable[..., None]]:
    """Call it with the cached library loaders a test reads (e.g. `attention.decode_library`): they are built for
    x86-64-v3 (AVX2 and FMA, no AVX-512) from then on, and this machine's build again after the test. Skips where the
    CPU cannot run that build."""
    cleared = []

    def use(*loaders) -> None:
        monkeypatch.setenv("STRATA_KERNEL_MARCH", "x86-64-v3")
        try:
            build.compiler_flags()
        except ConfigError:
            pytest.skip("this CPU cannot run an x86-64-v3 build")
        cleared.extend(loaders)
        build.load.cache_clear()
        for loader in loaders:
            loader.cache_clear()

    yield use
    monkeypatch.delenv("STRATA_KERNEL_MARCH", raising=False)
    build.load.cache_clear()
    for loader in cleared:
        loader.cache_clear()
