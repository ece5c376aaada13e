"""An input-grounded workload built from text that ships with Python: stdlib functions to repeat with one name
changed, and docstrings to quote from. The kind of work speculative decoding speeds up (the output copies much of
the prompt), made from real code and prose without any download."""
from __future__ import annotations

import inspect
import random
import re
from typing import Any

# Modules whose pure-Python functions make the prompts (present in every CPython build).
_MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "difflib", "heapq", "bisect", "calendar", "string",
            "json.encoder", "json.decoder", "csv", "glob", "tokenize", "argparse", "configparser", "urllib.parse",
            "email.utils", "html", "base64", "pprint", "dataclasses", "functools", "copy", "ftplib", "gettext")
_IDENTIFIER = re.compile(r"\b[a-z_][a-z0-9_]{2,}\b")


def _functions(min_chars: int, max_chars: int) -> list[Any]:
    import importlib

    found = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            if fn.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if min_chars <= len(source) <= max_chars:
                found.append(fn)
    return found


def _rename_task(fn: Any) -> str | None:
    """'Repeat this function with one name changed': the name is a parameter or local used at least twice."""
    source = inspect.getsource(fn)
    names = [n for n in inspect.signature(fn).parameters if n not in ("self", "cls")]
    names += _IDENTIFIER.findall(source)
    for old in names:
        if len(re.findall(rf"\b{re.escape(old)}\b", source)) >= 2 and not old.startswith("__"):
            new = "new_" + old.lstrip("_")
            return (f"Repeat this Python function exactly, but rename `{old}` to `{new}` everywhere. Reply with the "
                    f"code only.\n\n```python\n{source}```")
    return None


def _quote_task(fn: Any) -> str | None:
    """'Quote the sentence of this docstring that says X': a docstring of several sentences."""
    doc = inspect.getdoc(fn)
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", doc or "") if len(s.split()) >= 6]
    if len(sentences) < 3:
        return None
    words = [w for w in _IDENTIFIER.findall(sentences[1]) if len(w) > 4] or sentences[1].split()[:1]
    return (f"Here is the documentation of `{fn.__name__}`:\n\n{doc}\n\nQuote, word for word, the sentence of it that "
            f"mentions \"{words[0]}\", then repeat the whole documentation.")


def grounded_texts(num_prompts: int, seed: int = 0, max_chars: int = 2400) -> list[str]:
    """`num_prompts` instructions (repeating the set when it is exhausted), in an order fixed by `seed`."""
    tasks = []
    for fn in _functions(300, max_chars):
        for make in (_rename_task, _quote_task):
            task = make(fn)
            if task is not None:
                tasks.append(task)
    random.Random(seed).shuffle(tasks)
    if not tasks:
        raise RuntimeError("no stdlib source found for the grounded workload (is this Python's source installed?)")
    return [tasks[i % len(tasks)] for i in range(num_prompts)]


def grounded_prompts(tokenizer: Any, num_prompts: int, seed: int = 0, max_input_len: int | None = None
                     ) -> list[list[int]]:
    """The instructions as token ids, through the tokenizer's chat template when it has one; prompts longer than
    `max_input_len` tokens are skipped."""
    prompts: list[list[int]] = []
    for text in grounded_texts(4 * num_prompts + 16, seed):
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer(text).input_ids
        if max_input_len is None or len(ids) <= max_input_len:
            prompts.append(ids)
        if len(prompts) == num_prompts:
            break
    return prompts
