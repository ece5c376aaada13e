"""The engine's side of structured outputs: requests waiting for their grammar, one matcher per constrained
sequence, and each step's bitmask (filled on a thread while the step's forward runs)."""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from strata.config import EngineConfig
from strata.engine.request import Request
from strata.errors import RequestError, StrataError
from strata.executor.step import GrammarBitmask, SchedulerOutput
from strata.sampling_params import StructuredOutputsParams
from strata.structured.grammar import BitmaskFiller, GrammarCompiler, compile_timeout

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, config: EngineConfig, tokenizer: Any, stop_token_ids: set[int]) -> None:
        self.config = config.structured
        self.compiler = GrammarCompiler(tokenizer, config.model.vocab_size, sorted(stop_token_ids), config.structured)
        self.filler = BitmaskFiller(config.model.vocab_size)
        self.matchers: dict[str, Any] = {}  # scheduler request id -> xgrammar.GrammarMatcher
        # group id -> (compile, deadline, the group's scheduler requests)
        self.waiting: dict[str, tuple[Future, float, list[Request]]] = {}

    def add(self, group_id: str, params: StructuredOutputsParams, requests: list[Request]) -> None:
        """Start (or share) the grammar's compilation; the requests wait here until it is ready."""
        future = self.compiler.submit(params)
        self.waiting[group_id] = (future, time.monotonic() + self.config.timeout_s, requests)

    def ready(self) -> tuple[list[Request], list[tuple[str, StrataError]]]:
        """Requests whose grammar is ready (each now with its matcher), and groups whose grammar failed."""
        admitted, failed = [], []
        now = time.monotonic()
        for group_id, (future, deadline, requests) in list(self.waiting.items()):
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
            admitted.extend(requests)
        return admitted, failed

    def wait(self, timeout_s: float) -> None:
        """Sleep until a waiting grammar is ready (or `timeout_s`), instead of spinning an idle step loop."""
        if self.waiting:
            wait([f for f, _, _ in self.waiting.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def bitmask(self, sched: SchedulerOutput) -> GrammarBitmask | None:
        """The step's bitmask for its constrained rows that sample; filled on a thread while the forward runs."""
        rows = [s.request_id for s in sched.requests if s.sample and s.request_id in self.matchers]
        if not rows:
            return None
        return GrammarBitmask(rows, self.filler.fill_async([self.matchers[r] for r in rows]))

    def accept(self, request_id: str, token: int) -> bool:
        """Feed a sampled token to the sequence's matcher; True when the grammar is finished."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            # Cannot happen while the bitmask is applied; end the sequence rather than continue unconstrained.
            logger.error("request %s sampled token %d that its grammar rejects", request_id, token)
            return True
        return matcher.is_terminated()

    def constrained(self, request_id: str) -> bool:
        return request_id in self.matchers

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.waiting.pop(request_id, None)

    def shutdown(self) -> None:
        self.compiler.shutdown()
        self.filler.shutdown()
