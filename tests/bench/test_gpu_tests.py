"""Child processes of the GPU check: a timeout kills the whole group; pytest outcomes are counted."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from strata.bench.gpu_tests import run_gpu_tests, run_killable, summary_counts


def test_a_timeout_kills_the_child_and_what_it_started(tmp_path):
    # The child starts a grandchild that would write a file after 3 s, then sleeps itself.
    marker = tmp_path / "grandchild-survived"
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              f"\"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).write_text('x')\"]); "
              f"print('started', flush=True); time.sleep(60)")
    started = time.monotonic()
    returncode, timed_out, output = run_killable([sys.executable, "-c", script], Path.cwd(), dict(os.environ), 1.5)
    assert timed_out and returncode != 0 and "started" in output
    assert time.monotonic() - started < 10
    time.sleep(3)
    assert not marker.exists()


def test_a_child_that_finishes_reports_its_output_and_code():
    returncode, timed_out, output = run_killable([sys.executable, "-c", "print('hi'); raise SystemExit(3)"],
                                                 Path.cwd(), dict(os.environ), 30)
    assert (returncode, timed_out, output.strip()) == (3, False, "hi")


def test_pytest_summary_line_is_counted():
    output = "....F\n=== short test summary ===\nFAILED x\n2 failed, 5 passed, 1 skipped, 3 deselected, 1 error in 4s"
    assert summary_counts(output) == {"failed": 2, "passed": 5, "skipped": 1, "deselected": 3, "errors": 1}
    assert summary_counts("no summary at all") == {}


def _gpu_tests_in(folder: Path, conftest: str, tests: str) -> dict:
    (folder / "conftest.py").write_text(conftest)
    (folder / "test_gpu.py").write_text(tests)
    return run_gpu_tests(folder, ["test_gpu.py"], 120, folder)


def test_a_conftest_that_does_not_import_is_an_error_not_a_pass(tmp_path):
    result = _gpu_tests_in(tmp_path, "import no_such_package_here\n",
                           "import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    assert result["status"] == "error" and result["passed"] == 0
    assert "exited with 4" in result["summary"] and "no_such_package_here" in result["summary"]


def test_no_gpu_tests_collected_is_an_error(tmp_path):
    result = _gpu_tests_in(tmp_path, "", "def test_not_gpu():\n    pass\n")
    assert result["status"] == "error" and "exited with 5" in result["summary"]


def test_all_gpu_tests_passing_leaves_the_status_to_the_section(tmp_path):
    result = _gpu_tests_in(tmp_path, "", "import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    assert "status" not in result and result["passed"] == 1 and result["returncode"] == 0


# Test-only packages the GPU machine lacks (it has torch, triton and transformers, and nothing can be installed).
TEST_ONLY = ("gguf", "openai", "httpx", "lm_eval", "mlx", "mlx_lm", "vllm_router", "schemathesis", "jsonschema",
             "fastapi", "uvicorn")
HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ImportError(f"{{name}} is hidden")
sys.meta_path.insert(0, Hide())
"""


def test_the_gpu_tests_collect_without_test_only_packages(tmp_path):
    """On the GPU machine a conftest import of `gguf` once made `pytest -m gpu` collect nothing."""
    (tmp_path / "hide_test_only.py").write_text(HIDE.format(names=set(TEST_ONLY)))
    repo = Path(__file__).resolve().parents[2]
    # No plugins from entry points: those of test-only packages (schemathesis) are not on that machine either.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(repo)]), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    cmd = [sys.executable, "-m", "pytest", "-p", "hide_test_only", "-p", "no:cacheprovider", "--collect-only",
           "-q", "-m", "gpu", "tests/test_cuda.py", "tests/strata_kernels/triton"]
    returncode, timed_out, output = run_killable(cmd, repo, env, 120)
    assert returncode == 0 and not timed_out, output[-3000:]
    assert "tests/test_cuda.py::test_cuda_greedy_tokens_equal_cpu" in output
