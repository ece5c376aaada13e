"""Digit bounds for the numbers of JSON grammars: xgrammar writes an integer or number without a two-sided range as
an unbounded run of digits, which a small model can fill to max_tokens (`1111111...`); these rules cap each run.

The caps follow llama.cpp's JSON-schema grammars (16 integral and 16 fractional digits) and IEEE doubles, which is
what most JSON parsers turn a number into: at most 16 integral digits (every integer up to 9999999999999999, past
JavaScript's 2**53), at most 16 fractional digits, at most 3 exponent digits (a double's exponent is within +-308).
A schema with both `minimum` and `maximum` keeps xgrammar's own range rule, so larger integers remain possible.
"""
from __future__ import annotations

import re

MAX_INTEGER_DIGITS = 16
MAX_FRACTION_DIGITS = 16
MAX_EXPONENT_DIGITS = 3

# A rule holding one digit, e.g. `basic_number_digits ::= (([0-9]))`, which xgrammar repeats with `{1, -1}`.
_DIGIT_RULE = re.compile(r"^(\S+) ::= \(\(\[0-9\]\)\)$", re.MULTILINE)


def bound_number_digits(ebnf: str) -> str:
    """The grammar with every unbounded integral, fractional and exponent digit run capped (the rules above);
    regex rules (a string's `pattern`) and other digit runs (a URI's port) are left as they are."""
    digit = "|".join([re.escape("[0-9]"), *(re.escape(name) for name in _DIGIT_RULE.findall(ebnf))])
    rules = [
        # Integral part after its leading [1-9]: `[1-9] [0-9]*` (plain) or `[1-9] d{1, -1}` (one-sided ranges).
        (r"(\[1-9\] )\[0-9\]\*", rf"\1[0-9]{{0, {MAX_INTEGER_DIGITS - 1}}}"),
        (rf"(\[1-9\] (?:{digit}))\{{1, -1\}}", rf"\1{{1, {MAX_INTEGER_DIGITS - 1}}}"),
        # Fraction: `"." d{1, -1}`; exponent: `[eE] sign d{1, -1}`.
        (rf'("\." (?:{digit}))\{{1, -1\}}', rf"\1{{1, {MAX_FRACTION_DIGITS}}}"),
        (rf"(\[eE\] \S+ (?:{digit}))\{{1, -1\}}", rf"\1{{1, {MAX_EXPONENT_DIGITS}}}"),
    ]
    lines = ebnf.split("\n")
    for i, line in enumerate(lines):
        if "Regex(" in line:
            continue
        for pattern, replacement in rules:
            line = re.sub(pattern, replacement, line)
        lines[i] = line
    return "\n".join(lines)
