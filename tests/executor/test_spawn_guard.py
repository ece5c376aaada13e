"""An offline script that starts TP workers at import time, without a main guard, is told to add one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_a_script_without_a_main_guard_is_told_that_workers_reimport_it(llama5, tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(
        "from strata import LLM, SamplingParams\n"
        f"llm = LLM({str(llama5)!r}, tensor_parallel_size=2, max_model_len=64, kv_cache_memory=1 << 20)\n"
        "print('generated', llm.generate('Hello', SamplingParams(max_tokens=2)))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode != 0 and "generated" not in done.stdout
    last_line = done.stderr.strip().splitlines()
    # The driver's own error (its workers print theirs too): the cause, the script, and the guard to add.
    error = next(line for line in reversed(last_line) if line.startswith("strata.errors.ConfigError"))
    assert "exited with code 1 during start-up: spawned workers re-import the main module" in error
    assert str(script) in error
    assert '    if __name__ == "__main__":\n        llm = LLM(' in done.stderr
