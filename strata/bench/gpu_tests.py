"""Child processes with a timeout that kills all they started; the project's `pytest -m gpu` run in one, counted."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def junit_counts(path: Path) -> dict:
    """Outcome counts and the failing tests' ids from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "failed_tests": failed}


def summary_counts(output: str) -> dict:
    """Counts read from pytest's last summary line (used when it was killed before writing its XML)."""
    counts: dict[str, int] = {}
    for line in reversed(output.splitlines()):
        found = _SUMMARY.findall(line)
        if found:
            for number, word in found:
                counts["errors" if word.startswith("error") else word] = int(number)
            break
    return counts


def run_killable(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int, bool, str]:
    """(return code, timed out, stdout and stderr) of a command; on timeout its whole process group is killed,
    so that engine workers or compilers it started go with it."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, False, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return proc.returncode, True, output


def run_gpu_tests(root: Path, candidates: list[str], timeout_s: float, workdir: Path) -> dict:
    """`pytest -q -m gpu` on the given test paths that exist (never a whole folder that holds server tests)."""
    paths = [p for p in candidates if (root / p).exists()]
    junit = workdir / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfE",
           f"--junitxml={junit}", *paths]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    result = {"command": " ".join(cmd[1:]), "paths": paths,
              "missing_paths": [p for p in candidates if p not in paths], "timeout_s": round(timeout_s, 1)}
    if not paths:
        return result | {"summary": "no GPU test paths exist"}
    returncode, timed_out, output = run_killable(cmd, root, env, timeout_s)
    counts = junit_counts(junit) if junit.exists() and not timed_out else summary_counts(output)
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0) | counts
    result.update(returncode=returncode, timed_out=timed_out, **counts, output_tail=output[-6000:])
    words = [f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "skipped")]
    result["summary"] = ", ".join(words) + (" (TIMED OUT)" if timed_out else "")
    # pytest's codes: 0 all passed, 1 some failed; 2-4 it could not run them (e.g. a conftest that does not
    # import), 5 it collected none: either way the GPU tests did not run, which must not read as a pass.
    if timed_out or returncode not in (0, 1):
        why = "timed out" if timed_out else f"pytest exited with {returncode}: {first_error(output)}"
        result.update(status="error", summary=f"{result['summary']} ({why})")
    elif returncode == 1:
        result["status"] = "failed"
    return result


def first_error(output: str) -> str:
    """The line that says why pytest stopped: its first `E ` line, else its last non-empty one."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors or lines or ["no output"])[0 if errors else -1][:300]
