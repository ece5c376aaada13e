"""Grammar compilation on a small thread pool, cached by grammar; per-sequence matchers; each step's bitmask.

A request's grammar compiles while the step loop goes on; the request joins the batch once it is ready. Masks
are filled where the matchers live (the engine process) and travel with the step to the rank that samples.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from strata.config import StructuredOutputsConfig
from strata.errors import RequestError
from strata.sampling_params import StructuredOutputsParams
from strata.structured.json_numbers import bound_number_digits
from strata.structured.json_schema import load_schema

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


def _xgrammar() -> Any:
    """xgrammar, imported on first use: it imports triton, which reads TRITON_INTERPRET once, when imported; and
    engines that never see a constrained request do not pay for it."""
    import xgrammar

    return xgrammar

# xgrammar (0.2.9) lets strings with a maxLength hold raw control characters, which JSON forbids.
_STRING_CHAR, _JSON_STRING_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'
_CACHE_SIZE = 256  # compiled grammars kept (each holds its token-mask cache: tens of KB to a few MB)


def validate(params: StructuredOutputsParams) -> None:
    """The cheap checks, in the caller: JSON and keywords of a schema (the grammar's own syntax is checked by the
    compile, whose error names the same parameter)."""
    if params.json is not None:
        load_schema(params.json, "structured_outputs.json")


class GrammarCompiler:
    """Compiles StructuredOutputsParams into xgrammar grammars for one tokenizer and logits width."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], config: StructuredOutputsConfig,
                 max_workers: int = 2) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="strata-grammar")
        # Building the tokenizer info walks the vocabulary once; it happens on the pool, not in the step loop.
        self._compiler: Future[xgr.GrammarCompiler] = self._pool.submit(
            self._make_compiler, tokenizer, vocab_size, stop_token_ids)
        self._cache: OrderedDict[tuple, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_times: dict[tuple, float] = {}

    @staticmethod
    def _make_compiler(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.GrammarCompiler:
        xgr = _xgrammar()
        if hasattr(tokenizer, "token_bytes"):  # strata's own tokenizers (PLaMo2), which xgrammar does not know
            info = xgr.TokenizerInfo(tokenizer.token_bytes, xgr.VocabType.RAW, vocab_size=vocab_size,
                                     stop_token_ids=stop_token_ids, add_prefix_space=False)
        else:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=2)

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The grammar's compilation, started now or shared with an earlier request for the same grammar."""
        validate(params)
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._cache[key] = self._pool.submit(self._compile, params)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def compile(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """Wait for the grammar (at most the configured timeout); errors become RequestErrors naming the param."""
        return result_of(self.submit(params), params, timeout_s or self.config.timeout_s)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._compiler.result()
        started = time.perf_counter()
        param = f"structured_outputs.{params.kind}"
        try:
            compiled = self._compile_with(compiler, params)
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[0]
            reason = reason.split(": ", 1)[-1] if reason.startswith("[") else reason
            raise RequestError(f"{param} cannot be compiled: {reason}", param=param) from None
        except UnicodeDecodeError as e:  # xgrammar's message quoted a character cut in half: decode it leniently
            reason = e.object.decode(errors="replace").strip().splitlines()[0].split(": ", 1)[-1]
            raise RequestError(f"{param} cannot be compiled: {reason}", param=param) from None
        self.compile_times[params.key] = time.perf_counter() - started
        return compiled

    def _compile_with(self, compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        whitespace = {"any_whitespace": not params.disable_any_whitespace,
                      "max_whitespace_cnt": None if self.config.max_whitespace < 0 else self.config.max_whitespace}
        if params.json is not None or params.json_object:
            # Any object: not strict, or `{"type": "object"}` would admit only `{}`.
            schema, strict = (params.json, True) if params.json is not None else ('{"type": "object"}', False)
            schema = schema if isinstance(schema, str) else json.dumps(schema)
            grammar = str(_xgrammar().Grammar.from_json_schema(schema, strict_mode=strict, **whitespace))
            return compiler.compile_grammar(bound_number_digits(grammar.replace(_STRING_CHAR, _JSON_STRING_CHAR)))
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        return compiler.compile_grammar(params.grammar)

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return _xgrammar().GrammarMatcher(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def result_of(future: Future, params: StructuredOutputsParams, timeout_s: float) -> xgr.CompiledGrammar:
    """A compile's result, or a RequestError: its own, or one saying it took longer than `timeout_s`."""
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        raise compile_timeout(params, timeout_s) from None


def compile_timeout(params: StructuredOutputsParams, timeout_s: float) -> RequestError:
    param = f"structured_outputs.{params.kind}"
    return RequestError(f"{param} took longer than {timeout_s:g} s to compile (--structured-outputs-timeout); "
                        "simplify it", param=param)


class BitmaskFiller:
    """Fills the token bitmask of a step's constrained rows, on its own thread so that it overlaps the forward."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._xgr = _xgrammar()
        self._batch = self._xgr.BatchGrammarMatcher(max_threads=2)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-bitmask")
        self.total_fill_s, self.num_fills, self.max_rows = 0.0, 0, 0

    @property
    def mean_fill_s(self) -> float:
        return self.total_fill_s / max(self.num_fills, 1)

    def fill(self, matchers: list[xgr.GrammarMatcher], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """One row per matcher; with `drafts` (speculative decoding), one per position of each matcher's draft and
        one after it: the matcher steps through its draft (which it accepts) and back."""
        started = time.perf_counter()
        drafts = drafts or [[]] * len(matchers)
        bitmask = self._xgr.allocate_token_bitmask(sum(len(d) + 1 for d in drafts), self.vocab_size)
        plain, rows, row = [], [], 0
        for matcher, draft in zip(matchers, drafts, strict=True):
            if draft:
                for position, token in enumerate(draft):
                    matcher.fill_next_token_bitmask(bitmask, row + position)
                    matcher.accept_token(token)
                matcher.fill_next_token_bitmask(bitmask, row + len(draft))
                matcher.rollback(len(draft))
            else:
                plain.append(matcher)
                rows.append(row)
            row += len(draft) + 1
        if plain:
            self._batch.batch_fill_next_token_bitmask(plain, bitmask, rows)
        self.total_fill_s += time.perf_counter() - started
        self.num_fills += 1
        self.max_rows = max(self.max_rows, row)
        return bitmask

    def fill_async(self, matchers: list[xgr.GrammarMatcher], drafts: list[list[int]] | None = None
                   ) -> Future[torch.Tensor]:
        return self._pool.submit(self.fill, matchers, drafts)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
