"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py, run from the llama.cpp sources that the
llama-cpp-python sdist vendors, in a subprocess with its own gguf-py) from tiny random checkpoints: the oracle for
architectures whose GGUF files transformers cannot load. The sources are found under $STRATA_LLAMA_CPP, else where
shared/tools/llama_cpp_anchor.sh unpacks them; without them the tests that need a conversion are skipped
(`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36` and unpack it to get them)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LLAMA_CPP = Path(os.environ.get("STRATA_LLAMA_CPP", "~/.cache/strata-anchors/llama_cpp_python-0.3.36/vendor/llama.cpp")
                 ).expanduser()
# The test checkpoints' tokenizer is not one llama.cpp knows by its hash: it is written as GPT-2 style BPE, as
# llama_cpp_anchor.sh does.
# Several conversions share one process: importing the converter (torch, transformers) costs more than converting
# a tiny checkpoint.
_SCRIPT = """
import sys
src, jobs = sys.argv[1], sys.argv[2:]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
import convert_hf_to_gguf as convert
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
for model, out, outtype in zip(jobs[0::3], jobs[1::3], jobs[2::3]):
    sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
    convert.main()
"""


def convert(hf_folder: Path, out: Path, outtype: str = "f32") -> Path:
    """`hf_folder` as llama.cpp's converter writes it (`outtype` f32, f16, bf16 or q8_0)."""
    return convert_many([(hf_folder, out, outtype)])[0]


def convert_many(jobs: list[tuple[Path, Path, str]]) -> list[Path]:
    """Each (checkpoint folder, GGUF path, outtype) converted, all in one converter process."""
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {LLAMA_CPP} (set STRATA_LLAMA_CPP to a llama.cpp source tree)")
    args = [str(part) for job in jobs for part in job]
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(LLAMA_CPP), *args], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-4000:]}")
    return [out for _, out, _ in jobs]
