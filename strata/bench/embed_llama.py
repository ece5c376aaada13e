"""llama.cpp's `llama-embedding` on the sentences of `strata bench embed` (a GGUF of the same checkpoint, converted by
llama.cpp's convert_hf_to_gguf.py): its seconds, and its embeddings for a sanity check against strata's."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_TRIES = 3


def _parse(stdout: str) -> torch.Tensor | None:
    """The [[...], ...] array `--embd-output-format array` prints; None when it is cut short."""
    try:
        return torch.tensor(json.loads(stdout[stdout.index("["):]))
    except ValueError:
        return None


@dataclass(frozen=True)
class LlamaEmbedding:
    binary: Path
    gguf: Path
    threads: int
    pooling: str  # mean | cls | last
    normalize: bool
    batch_tokens: int  # llama.cpp's n_ctx = n_batch = n_ubatch: tokens of one encoder batch, as strata's budget

    def run(self, sentences: list[str]) -> tuple[float, torch.Tensor]:
        """(wall seconds, [len(sentences), hidden] embeddings) of one llama-embedding process over `sentences`."""
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(sentences))
        try:
            # llama.cpp's logger (which prints the vectors too) is a queue it never drains at exit, so a run may end
            # with status 0 before its last lines are out: run again when the array is cut short.
            for _ in range(_TRIES):
                started = time.perf_counter()
                done = subprocess.run(self._command(f.name), capture_output=True, text=True, env=self._env(),
                                      timeout=3600)
                seconds = time.perf_counter() - started
                if done.returncode != 0:
                    raise SystemExit(f"{self.binary} failed ({done.returncode}):\n{done.stderr[-3000:]}")
                vectors = _parse(done.stdout)
                if vectors is not None and vectors.shape[0] == len(sentences):
                    return seconds, vectors
        finally:
            os.unlink(f.name)
        raise SystemExit(f"{self.binary} did not print {len(sentences)} embeddings in {_TRIES} runs:\n"
                         f"{done.stdout[-500:]}{done.stderr[-2000:]}")

    def seconds(self, sentences: list[str]) -> float:
        """Seconds spent embedding `sentences`: a run's wall time less a one-sentence run's (process start and
        model load), both measured now so that a shared machine's load hits them alike."""
        full, _ = self.run(sentences)
        startup, _ = self.run(sentences[:1])
        return max(full - startup, 1e-9)

    def _command(self, prompt_file: str) -> list[str]:
        n = str(self.batch_tokens)
        return [str(self.binary), "-m", str(self.gguf), "-f", prompt_file, "-t", str(self.threads), "--pooling",
                self.pooling, "-c", n, "-b", n, "-ub", n, "--embd-output-format", "array", "--embd-normalize",
                "2" if self.normalize else "-1"]

    def _env(self) -> dict[str, str]:
        """The binary's own folder first on the library path: a CMake build keeps libllama and libggml beside it."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.binary.parent), env.get("LD_LIBRARY_PATH")]))
        return env
