"""`python -m strata.server --model MODEL ...`: vLLM's old entry-point form, the same flags as `strata serve`.
It runs `python -m strata serve ...` the way -m itself does (runpy): the server package sits below the CLI and
does not import it."""
from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.argv[1:1] = ["serve"]
    runpy.run_module("strata", run_name="__main__", alter_sys=True)
