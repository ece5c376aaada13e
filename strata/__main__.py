"""python -m strata -> the command line."""
from __future__ import annotations

import sys

from strata.cli import main

sys.exit(main())
