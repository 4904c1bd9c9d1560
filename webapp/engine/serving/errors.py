"""Exceptions the engine raises at its submit boundary; the web layer maps them to HTTP statuses.

`QueueFull` -> 429 with a `Retry-After` header, `EngineNotReady` -> 503 with `RETRY_AFTER_S`,
`ModelLoadFailed` -> 503 `model_load_failed` with no `Retry-After`, `PromptTooLong` -> 400
`context_length_exceeded`. Stdlib only, so the web layer and its tests can import these without
pulling in the model code.

`completion_room` is the one prompt-length check: the API calls it before building a request (to
size `max_tokens`, with the server's own prompt limit) and `Engine.submit` calls it again to guard
the cache, so both refuse with the same error and the same words.
"""

from __future__ import annotations

# How long a client should wait before trying again while this server does not serve at all (the
# model still loading, or a drain under way): a 503's Retry-After, wherever it is sent. A full queue
# instead says how long its own queue takes to move (`QueueFull.retry_after`).
RETRY_AFTER_S = 10


class EngineNotReady(Exception):
    """The engine cannot take requests: the model is still loading, failed, or is shutting down."""


class ModelLoadFailed(EngineNotReady):
    """The model's file failed to load. Waiting will not help: it stays failed until the file changes
    (a model set tries a changed file again) or the server restarts with another."""


class QueueFull(Exception):
    """The waiting queue is at its limit; the client should retry after `retry_after` seconds."""

    def __init__(self, retry_after: int = 1, message: str = "Too many requests are waiting.") -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class PromptTooLong(ValueError):
    """The prompt leaves no room for a completion in the context, or is over the server's limit."""

    def __init__(self, message: str, prompt_tokens: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens


def completion_room(prompt_tokens: int, max_context: int, max_prompt_tokens: int | None = None) -> int:
    """How many tokens a completion may have after this prompt (at least 1), or `PromptTooLong`."""
    if max_prompt_tokens and prompt_tokens > max_prompt_tokens:
        raise PromptTooLong(
            f"The prompt has {prompt_tokens} tokens; this server accepts at most {max_prompt_tokens}.",
            prompt_tokens,
        )
    room = max_context - prompt_tokens
    if room < 1:
        raise PromptTooLong(
            f"This model's maximum context length is {max_context} tokens, but the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for a completion. "
            "Please shorten the prompt.",
            prompt_tokens,
        )
    return room
