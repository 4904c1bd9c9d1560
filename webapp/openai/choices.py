"""The `n` choices of one API request: n engine requests whose outputs one handler thread reads.

Each choice is its own `Request` (own slot, own sampler, seed + index), so the engine needs nothing
new: the scheduler copies the shared prompt's cache from the first choice's slot instead of
prefilling it n times. Their outputs meet on one queue (`ChoiceOutputs`), tagged with the choice's
index, so a streaming handler can send whichever choice has produced something instead of blocking
on one while the others wait.

Reading is the handler's side of the engine's contract, for one choice or several: an `Answer`
holds a `ChoiceReader` per submitted choice, which turns its token ids into text (stop strings
applied), engine failures into `ApiError`s and a vanished client into `ClientGone`. No Flask here:
the view passes in the client's disconnect check and the lifecycle.
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Callable, Iterator
from functools import partial

from webapp.engine.serving.errors import RETRY_AFTER_S
from webapp.engine.serving.request import Finished, FinishReason, Request
from webapp.openai import response_bodies
from webapp.openai.errors import ApiError
from webapp.openai.output_text import StopMatcher

log = logging.getLogger(__name__)

# How often a reader blocked on the output queue checks whether its client is still there.
_POLL_S = 0.5
_ENGINE_FAILED = "The engine failed while generating this completion."


class ClientGone(Exception):
    """The HTTP client disconnected while its request was being generated."""


class _Outbox:
    """What the engine sees as one request's `outputs`: it only ever calls `put`."""

    def __init__(self, shared: queue.Queue, index: int):
        self._shared, self._index = shared, index

    def put(self, item) -> None:
        self._shared.put((self._index, item))


class ChoiceOutputs:
    def __init__(self, n: int):
        self._shared: queue.Queue = queue.Queue()
        self._pending = [collections.deque() for _ in range(n)]

    def outbox(self, index: int) -> _Outbox:
        return _Outbox(self._shared, index)

    def get(self, index: int, timeout: float):
        """Choice `index`'s next output; queue.Empty when none arrived within `timeout`. Outputs of
        other choices that arrive meanwhile wait in their own buffers."""
        while not self._pending[index]:
            other, item = self._shared.get(timeout=timeout)
            self._pending[other].append(item)
        return self._pending[index].popleft()

    def waiting(self) -> set[int]:
        """The choices that have outputs no one has read yet."""
        while True:
            try:
                index, item = self._shared.get_nowait()
            except queue.Empty:
                break
            self._pending[index].append(item)
        return {i for i, pending in enumerate(self._pending) if pending}


def interleave(streams: list[Iterator[str]], outputs: ChoiceOutputs | None) -> Iterator[str]:
    """The choices' event streams as one: each choice's opening event, then whichever choice has
    outputs waiting. With nothing waiting it blocks on the lowest choice still running; the others'
    outputs buffer meanwhile (all choices decode in the same engine steps, so that is one step)."""
    if outputs is None:
        yield from streams[0]
        return
    running = {}
    for index, stream in enumerate(streams):
        opening = next(stream, None)
        if opening is not None:
            running[index] = stream
            yield opening
    while running:
        ready = sorted(outputs.waiting() & running.keys()) or [min(running)]
        for index in ready:
            event = next(running[index], None)
            if event is None:
                del running[index]
            else:
                yield event


class Answer:
    """The readers of one API request's choices, each added once its request is submitted, tracked
    by the lifecycle until `close()`. `outputs` is the choices' shared queue when there are several."""

    def __init__(self, answer_id: str, engine, outputs: ChoiceOutputs | None, stop: tuple[str, ...], disconnected, lifecycle):
        self.id, self.outputs = answer_id, outputs
        self.created = int(time.time())
        self.readers: list[ChoiceReader] = []
        self._engine, self._stop, self._disconnected, self._lifecycle = engine, stop, disconnected, lifecycle

    def submitted(self, req: Request) -> None:
        source = None if self.outputs is None else partial(self.outputs.get, len(self.readers))
        self.readers.append(ChoiceReader(self._engine, req, self._stop, self._disconnected, self._lifecycle, source))

    def usage(self) -> dict:
        first = self.readers[0].request
        completion = sum(r.completion_tokens for r in self.readers)
        drafted, accepted = (sum(getattr(r.request, name) for r in self.readers) for name in ("drafted_tokens", "accepted_tokens"))
        return response_bodies.usage(first.prompt_len, completion, first.cached_tokens, drafted, accepted)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


class ChoiceReader:
    """Reads one submitted request's outputs as text, applying stop strings.

    `texts()` yields decoded text as soon as it cannot be part of a stop string and returns when
    the request is done; `finish_reason` is then "stop" or "length". An engine failure raises a 5xx
    `ApiError` (503 when the server cancelled it, e.g. for shutdown); a client that disconnects
    while nothing arrives raises `ClientGone`. The request is tracked by `lifecycle` until
    `close()`, which also aborts it unless the engine has already finished it; it is idempotent.
    """

    def __init__(
        self,
        engine,
        req: Request,
        stop: tuple[str, ...],
        disconnected: Callable[[], bool] | None,
        lifecycle,
        source: Callable[[float], object] | None = None,
    ):
        self.engine = engine
        self.request = req
        self._lifecycle = lifecycle
        lifecycle.track(req)
        # where the outputs are read: the request's own queue, or its share of its choices' queue
        self._source = source or (lambda timeout: req.outputs.get(timeout=timeout))
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop string that ended it, if one did
        self._stop = stop
        self._disconnected = disconnected
        self._done = False  # the engine will put nothing more on the queue that we need

    def texts(self) -> Iterator[str]:
        decoder = self.engine.tokenizer.stream_decoder()
        matcher = StopMatcher(self._stop)
        while self.finish_reason is None:
            item = self._next()
            if isinstance(item, int):
                self.completion_tokens += 1
                text, matched = matcher.feed(decoder.add(item))
            elif isinstance(item, Finished):
                self._done = True
                if item.reason == FinishReason.SHUTDOWN:
                    raise ApiError(
                        503,
                        "The server is shutting down and cancelled this request before it finished.",
                        code="server_shutting_down",
                        headers={"Retry-After": str(RETRY_AFTER_S)},
                    )
                if item.reason == FinishReason.CANCELLED:  # not by us: we stop reading once we abort
                    raise ApiError(503, "The server cancelled the request.", code="cancelled")
                if item.reason not in (FinishReason.STOP, FinishReason.LENGTH):
                    raise ApiError(500, _ENGINE_FAILED, code="engine_error")
                text, matched = matcher.feed(decoder.flush())
                if not matched:
                    text += matcher.flush()
                    self.finish_reason = item.reason
            else:
                self._done = True
                # The details are for the log; the client learns only that generation failed.
                log.error("engine failed request %s: %r", self.request.id, item)
                raise ApiError(500, _ENGINE_FAILED, code="engine_error")
            if matched:
                self.close()  # the engine would go on generating text nobody will see
                self.finish_reason, self.stop_sequence = FinishReason.STOP, matcher.matched
            if text:
                yield text

    def _next(self):
        while True:
            try:
                return self._source(_POLL_S)
            except queue.Empty:
                if self._disconnected is not None and self._disconnected():
                    raise ClientGone from None

    def close(self) -> None:
        self._lifecycle.forget(self.request)
        if not self._done:
            self._done = True
            self.engine.abort(self.request)
