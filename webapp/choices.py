"""The `n` choices of one API request: n engine requests whose outputs one handler thread reads.

Each choice is its own `Request` (own slot, own sampler, seed + index), so the engine needs nothing
new: the scheduler copies the shared prompt's cache from the first choice's slot instead of
prefilling it n times. Their outputs meet on one queue (`ChoiceOutputs`), tagged with the choice's
index, so a streaming handler can send whichever choice has produced something instead of blocking
on one while the others wait.
"""

from __future__ import annotations

import collections
import queue
from collections.abc import Iterator


class _Outbox:
    """What the engine sees as one request's `outputs`: it only ever calls `put`."""

    def __init__(self, shared: queue.Queue, index: int):
        self._shared, self._index = shared, index

    def put(self, item) -> None:
        self._shared.put((self._index, item))

    def qsize(self) -> int:
        return self._shared.qsize()


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
