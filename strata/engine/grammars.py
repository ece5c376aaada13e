"""The engine's side of structured outputs: requests waiting for their grammar, one matcher per constrained
sequence, and each step's bitmask (filled on a thread while the step's forward runs). With a reasoning parser, a
thinking sequence's grammar waits for the end of its thinking: the answer is constrained, the thinking is not."""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from strata.config import EngineConfig
from strata.engine.request import Request
from strata.errors import RequestError, StrataError
from strata.executor.step import GrammarBitmask, SchedulerOutput
from strata.reasoning import ReasoningParser
from strata.sampling_params import StructuredOutputsParams
from strata.structured.grammar import BitmaskFiller, GrammarCompiler, compile_timeout

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, config: EngineConfig, tokenizer: Any, stop_token_ids: set[int],
                 reasoning: ReasoningParser | None = None) -> None:
        self.config = config.structured
        self.reasoning = reasoning
        self.compiler = GrammarCompiler(tokenizer, config.model.vocab_size, sorted(stop_token_ids), config.structured)
        self.filler = BitmaskFiller(config.model.vocab_size)
        self.matchers: dict[str, Any] = {}  # scheduler request id -> xgrammar.GrammarMatcher
        # group id -> (compile, deadline, the group's scheduler requests, whether their outputs start thinking)
        self.waiting: dict[str, tuple[Future, float, list[Request], bool]] = {}
        # Sequences whose grammar waits for the end of their thinking -> their newest tokens, as many as could
        # still be the start of the reasoning parser's end marker (one token, or harmony's header of several).
        self.thinking: dict[str, list[int]] = {}

    def add(self, group_id: str, params: StructuredOutputsParams, requests: list[Request],
            thinking: bool = False) -> None:
        """Start (or share) the grammar's compilation; the requests wait here until it is ready. `thinking`: the
        outputs start with thinking, which the grammar leaves free (needs the engine's reasoning parser)."""
        assert not thinking or self.reasoning is not None
        future = self.compiler.submit(params)
        self.waiting[group_id] = (future, time.monotonic() + self.config.timeout_s, requests, thinking)

    def ready(self) -> tuple[list[Request], list[tuple[str, StrataError]]]:
        """Requests whose grammar is ready (each now with its matcher), and groups whose grammar failed."""
        admitted, failed = [], []
        now = time.monotonic()
        for group_id, (future, deadline, requests, thinking) in list(self.waiting.items()):
            if not future.done() and now < deadline:
                continue
            del self.waiting[group_id]
            params = requests[0].sampling_params.structured_outputs
            if not future.done():
                failed.append((group_id, compile_timeout(params, self.config.timeout_s)))
                continue
            error = future.exception()
            if error is not None:
                failed.append((group_id, error if isinstance(error, StrataError) else RequestError(
                    f"structured_outputs cannot be compiled: {error}", param="structured_outputs")))
                continue
            for request in requests:
                self.matchers[request.request_id] = self.compiler.matcher(future.result())
                if thinking:
                    self.thinking[request.request_id] = []
            admitted.extend(requests)
        return admitted, failed

    def wait(self, timeout_s: float) -> None:
        """Sleep until a waiting grammar is ready (or `timeout_s`), instead of spinning an idle step loop."""
        if self.waiting:
            wait([f for f, *_ in self.waiting.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def bitmask(self, sched: SchedulerOutput) -> GrammarBitmask | None:
        """The step's bitmask for its constrained rows that sample; filled on a thread while the forward runs."""
        constrained = [s for s in sched.requests
                       if s.sample and s.request_id in self.matchers and s.request_id not in self.thinking]
        if not constrained:
            return None
        # With draft tokens a request has a row for each position they are verified at (its id once per row).
        rows = [s.request_id for s in constrained for _ in range(s.num_draft_tokens + 1)]
        drafts = [s.draft_token_ids for s in constrained] if any(s.num_draft_tokens for s in constrained) else None
        return GrammarBitmask(rows, self.filler.fill_async([self.matchers[s.request_id] for s in constrained], drafts))

    def valid_prefix(self, request_id: str, draft: list[int]) -> list[int]:
        """The draft up to the first token the sequence's grammar refuses, or that ends it (the row after such a
        token would have no grammar state to be masked by). A thinking sequence's draft stops before the end of its
        thinking, so that every row it is verified at is still unconstrained."""
        if request_id in self.thinking:
            tail = list(self.thinking[request_id])
            for i, token in enumerate(draft):
                if self._ends_thinking(tail, token):
                    return draft[:i]
            return draft
        matcher = self.matchers[request_id]
        taken = keep = 0  # tokens the matcher accepted; of those, the ones before any that ended the grammar
        for token in draft:
            if not matcher.accept_token(token):
                break
            taken += 1
            if matcher.is_terminated():
                break
            keep = taken
        if taken:
            matcher.rollback(taken)
        return draft[:keep]

    def accept(self, request_id: str, token: int) -> bool:
        """Feed a sampled token to the sequence's matcher; True when the grammar is finished. While the sequence
        thinks, its tokens pass the grammar by; the token that ends the thinking starts it."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        tail = self.thinking.get(request_id)
        if tail is not None:
            if self._ends_thinking(tail, token):
                del self.thinking[request_id]
            return False
        if not matcher.accept_token(token):
            # Cannot happen while the bitmask is applied; end the sequence rather than continue unconstrained.
            logger.error("request %s sampled token %d that its grammar rejects", request_id, token)
            return True
        return matcher.is_terminated()

    def _ends_thinking(self, tail: list[int], token: int) -> bool:
        """Append `token` to a thinking sequence's `tail` (kept one token shorter than the end marker); True when
        the two together are the marker."""
        end = self.reasoning.end_ids
        tail.append(token)
        if tail[-len(end):] == list(end):
            return True
        del tail[:max(0, len(tail) - len(end) + 1)]
        return False

    def constrained(self, request_id: str) -> bool:
        return request_id in self.matchers

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.waiting.pop(request_id, None)
        self.thinking.pop(request_id, None)

    def shutdown(self) -> None:
        self.compiler.shutdown()
        self.filler.shutdown()
