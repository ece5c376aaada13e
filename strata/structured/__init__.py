"""Structured outputs: grammar compilation (xgrammar), per-sequence matchers and the token bitmask of each step."""
