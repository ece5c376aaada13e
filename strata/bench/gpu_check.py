"""The one-GPU check of issue 12, run as is by a session that borrows a GPU (offline API only, no server imports):
`PYTHONPATH=. python3 -m strata.bench.gpu_check --out $OUT/gpu_check.json` (`--device cpu --quick` to try it here).

Each section runs in a child process of its own with a timeout, so that a crash, a hang or a poisoned CUDA context
costs that section only; its result or traceback goes in the JSON report, rewritten after every section. Sections
that would start past `--budget-s` are skipped. A kernel module in strata.kernels.triton may define
`benchmark(**kw) -> dict` (taking any of device, dtype, quick); its dict goes in the report.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from strata.bench.gpu_sections import SECTIONS, Context
from strata.bench.gpu_tests import run_killable

logger = logging.getLogger(__name__)

IN_PARENT = {"gpu_tests"}  # already a child process (pytest) with its own timeout
THROUGHPUT_PAIRS = ("llama", "mamba2")


def execute(name: str, ctx: Context) -> dict:
    """Runs one section here; its entry: status, result or traceback, seconds, peak CUDA memory of this process."""
    section = SECTIONS[name][0]
    started = time.perf_counter()
    try:
        result = section(ctx)
        # A section may say it ran but did not pass (the GPU tests); its result is kept either way.
        entry = {"status": result.pop("status", "ok"), "result": result}
    except (Exception, SystemExit):  # SystemExit: argparse refusing flags, e.g. after a CLI change
        entry = {"status": "error", "error": traceback.format_exc()}
    entry["elapsed_s"] = round(time.perf_counter() - started, 2)
    gc.collect()
    # Only where the section used CUDA here: the parent, which runs pytest, never opens a CUDA context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        entry["cuda_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.empty_cache()
    return entry


class Check:
    """The parent: runs each section (in a child process unless --isolation inline), keeps the report."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.started = time.monotonic()
        self.report: dict = {"meta": {"argv": sys.argv[1:], "device": args.device, "dtype": args.dtype,
                                      "quick": args.quick, "budget_s": args.budget_s, "finished": False},
                             "sections": {}, "comparisons": {}}

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def write(self) -> None:
        self.report["meta"]["elapsed_s"] = round(time.monotonic() - self.started, 2)
        self.report["comparisons"] = comparisons(self.report["sections"])
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=repr))
        os.replace(tmp, out)  # a kill mid-write never leaves half a report

    def run(self, name: str) -> None:
        _, min_s, max_s = SECTIONS[name]
        min_s = 0 if self.args.quick else min_s
        if self.left_s() < min_s or self.left_s() <= 0:
            self.report["sections"][name] = {"status": "skipped", "note": f"{self.left_s():.0f} s of the budget "
                                             f"left, the section needs ~{min_s:.0f} s"}
            self.write()
            return
        self.report["sections"][name] = {"status": "running"}  # what a kill of the whole script leaves
        self.write()
        timeout, started = max(min_s, min(max_s, self.left_s())), time.perf_counter()
        if self.args.isolation == "inline" or name in IN_PARENT:
            entry = execute(name, Context(self.args, self.workdir, time.monotonic() + self.left_s()))
        else:
            entry = self._run_child(name, timeout)
        entry["wall_s"] = round(time.perf_counter() - started, 2)  # with the child's start-up
        self.report["sections"][name] = entry
        self.write()

    def _run_child(self, name: str, timeout: float) -> dict:
        result = self.workdir / f"{name}.result.json"
        cmd = [sys.executable, "-m", "strata.bench.gpu_check", "--device", self.args.device, "--dtype",
               self.args.dtype, "--seed", str(self.args.seed), "--budget-s", f"{self.left_s():.1f}",
               "--pytest-timeout-s", str(self.args.pytest_timeout_s), "--workdir", str(self.workdir),
               "--child", name, "--out", str(result), *(["--quick"] if self.args.quick else [])]
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        returncode, timed_out, output = run_killable(cmd, root, env, timeout)
        if result.exists() and not timed_out:
            return json.loads(result.read_text())
        why = f"timed out after {timeout:.0f} s" if timed_out else f"child exited with {returncode}, no result"
        return {"status": "error", "error": why, "output_tail": output[-6000:]}


def comparisons(sections: dict) -> dict:
    """strata over transformers, output tokens/s, for each model where both ran."""
    ratios = {}
    for family in THROUGHPUT_PAIRS:
        ours = sections.get(f"{family}_strata", {}).get("result")
        theirs = sections.get(f"{family}_transformers", {}).get("result")
        if ours and theirs:
            ratios[family] = {"strata_output_tok_s": ours["output_tokens_per_second"],
                              "transformers_output_tok_s": theirs["output_tokens_per_s"],
                              "ratio": round(ours["output_tokens_per_second"] / theirs["output_tokens_per_s"], 3)}
    return ratios


def summary_table(report: dict) -> str:
    rows = [f"{'section':<22} {'status':<8} {'time':>8}  result"]
    for name, entry in report["sections"].items():
        if "result" in entry:
            detail = entry["result"].get("summary", "")
        else:
            lines = (entry.get("note") or entry.get("error") or "").strip().splitlines()
            detail = lines[-1] if lines else ""
        seconds = entry.get("wall_s", entry.get("elapsed_s", 0))
        rows.append(f"{name:<22} {entry['status']:<8} {seconds:>7.1f}s  {detail}")
    for family, c in report.get("comparisons", {}).items():
        rows.append(f"{family}: strata / transformers output tok/s = {c['ratio']:.2f}x")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m strata.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="the JSON report")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quick", action="store_true", help="tiny models and few prompts (a smoke test)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="sections that would start later are skipped")
    parser.add_argument("--pytest-timeout-s", type=float, default=150.0)
    parser.add_argument("--gpu-tests", default="tests/test_cuda.py,tests/strata_kernels/triton",
                        help="comma-separated paths for `pytest -m gpu`, those that exist (never a folder that holds "
                             "server tests: they import fastapi)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, from: " + ",".join(SECTIONS))
    parser.add_argument("--isolation", default="process", choices=["process", "inline"],
                        help="inline: every section in this process (faster, but one crash ends the run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one section, write its entry
    return parser


def _run_all(args: argparse.Namespace, workdir: Path) -> dict:
    names = args.sections.split(",")
    unknown = set(names) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))}")
    check = Check(args, workdir)
    for name in SECTIONS:
        if name in names:
            check.run(name)
    check.report["meta"]["finished"] = True
    check.write()
    sys.stdout.write(summary_table(check.report) + f"\nreport: {args.out}\n")
    return check.report


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.child:
        ctx = Context(args, Path(args.workdir), time.monotonic() + args.budget_s)
        entry = execute(args.child, ctx)
        Path(args.out).write_text(json.dumps(entry, indent=1, default=repr))
        return entry
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return _run_all(args, Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="strata-gpu-check-") as workdir:
        return _run_all(args, Path(workdir))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
