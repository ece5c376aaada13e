"""`python -m strata.server --model MODEL ...`: vLLM's old entry-point form, the same flags as `strata serve`."""
from __future__ import annotations

import sys

from strata.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
