"""The server's door, as ASGI middleware: bodies over the size limit get 413; past --max-waiting-requests new
generation requests get 503 + Retry-After; a draining server answers 503 to everything new (so routers move
away); requests in flight are counted, so a drain knows when it is done."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata.errors import OverloadedError, RequestTooLargeError, StrataError
from strata.server.protocol import error_body

logger = logging.getLogger(__name__)

# Prometheus keeps scraping a draining server: the drain itself is worth watching.
_OPEN_WHILE_DRAINING = frozenset({"/metrics"})
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})


class Gate:
    """The state the middleware and the drain share (one per app)."""

    def __init__(self, max_request_bytes: int | None = None, max_waiting: int | None = None) -> None:
        self.max_request_bytes = max_request_bytes
        self.max_waiting = max_waiting
        self.running: Callable[[], int] = lambda: 0  # sequences the engine runs now
        self.draining = False
        self.in_flight = 0
        self.generating = 0  # generation requests in flight: running ones, and the rest wait

    def overloaded(self) -> OverloadedError | None:
        """Counted when a request arrives (before any await), so a burst cannot slip past the bound."""
        if self.max_waiting is None:
            return None
        waiting = self.generating - self.running()
        if waiting < self.max_waiting:
            return None
        return OverloadedError(f"the server is overloaded: {waiting} requests are waiting "
                               f"(--max-waiting-requests {self.max_waiting}); retry later")

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight, False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


class GateMiddleware:
    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gate = self.gate
        gate.in_flight += 1
        try:
            if gate.draining and scope["path"] not in _OPEN_WHILE_DRAINING:
                await _send_error(send, OverloadedError("the server is shutting down"), close=True)
                return
            if scope["path"] in _GENERATION_PATHS and scope["method"] == "POST":
                await self._generate(scope, receive, send)
                return
            await self._call(scope, receive, send)
        finally:
            gate.in_flight -= 1

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self.gate.overloaded()
        if error is not None:
            await _send_error(send, error)
            return
        self.gate.generating += 1
        try:
            await self._call(scope, receive, send)
        finally:
            self.gate.generating -= 1

    async def _call(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.gate.max_request_bytes
        if limit is not None:
            if _content_length(scope) > limit:
                await _send_error(send, _too_large(limit))
                return
            receive = _limited(receive, limit)
        await self.app(scope, receive, send)


def _too_large(limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(f"the request body is larger than the server's limit of {limit} bytes "
                                "(--max-request-bytes)", param="body")


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that fails once the body (sent in chunks, without a Content-Length) passes `limit`."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large(limit)
        return message

    return wrapped


async def _send_error(send: Send, exc: StrataError, close: bool = False) -> None:
    status, body = error_body(exc)
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in error_headers(exc).items()]
    if close:
        headers.append((b"connection", b"close"))
    payload = body.model_dump_json().encode()
    headers.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def error_headers(exc: Any) -> dict[str, str]:
    """Retry-After on answers that ask the client to come back later."""
    retry_after = getattr(exc, "retry_after_s", None)
    return {} if retry_after is None else {"Retry-After": str(retry_after)}
