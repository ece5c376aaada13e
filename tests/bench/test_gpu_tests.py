"""Child processes of the GPU check: a timeout kills the whole group; pytest outcomes are counted."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from strata.bench.gpu_tests import run_killable, summary_counts


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
