"""Exceptions the engine raises at its submit boundary; the web layer maps them to HTTP statuses.

`QueueFull` -> 429 with a `Retry-After` header, `EngineNotReady` -> 503. Stdlib only, so the web
layer and its tests can import these without pulling in the model code.
"""

from __future__ import annotations


class EngineNotReady(Exception):
    """The engine cannot take requests: the model is still loading, failed, or is shutting down."""


class QueueFull(Exception):
    """The waiting queue is at its limit; the client should retry after `retry_after` seconds."""

    def __init__(
        self, retry_after: int = 1, message: str = "Too many requests are waiting."
    ) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))
