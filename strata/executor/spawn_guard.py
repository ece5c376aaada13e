"""Spawned workers re-run the parent's main script before they start: a script that creates an LLM with TP/PP at
import time, without `if __name__ == "__main__":`, would start engines inside its own workers. This names that
mistake, in the worker (which refuses to start a second engine) and in the driver (which sees it die)."""
from __future__ import annotations

import ast
import multiprocessing
import sys
from pathlib import Path

from strata.errors import ConfigError

_GUARD_EXAMPLE = """
    from strata import LLM

    if __name__ == "__main__":
        llm = LLM(model=..., tensor_parallel_size=...)
        ...
"""


def guard_message(script: str) -> str:
    return (f"spawned workers re-import the main module ({script}), and it starts an engine with TP/PP at import "
            "time, so every worker started one of its own and died. Create the LLM (and everything that uses it) "
            f"under a main guard:\n{_GUARD_EXAMPLE}")


def refuse_engine_in_spawn_bootstrap() -> None:
    """In a spawned process that is still importing its parent's main module, starting workers is that mistake."""
    # multiprocessing's own marker of this phase; it raises a generic RuntimeError on the same condition.
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # The script runs as __mp_main__ while it is imported; __main__ is spawn's own until then.
        script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the parent's __main__"
        raise ConfigError(guard_message(script), param="__main__")


def unguarded_main_script() -> str | None:
    """The main script spawned workers re-run, if it has no `if __name__ == "__main__":` at its top level."""
    script = _main_script()
    if script is None:
        return None
    try:
        tree = ast.parse(Path(script).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    return None if any(_is_main_guard(node) for node in tree.body) else script


def _main_script() -> str | None:
    """What spawn re-runs in each child: the parent's main file, unless it is a package's __main__ (as in
    `python -m strata`), an interactive session or `python -c`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name == "__main__" or spec.name.endswith(".__main__")):
        return None
    path = getattr(main, "__file__", None)
    return path if path and Path(path).is_file() else None


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))
