"""Stored responses, for `previous_response_id` chaining and `GET /v1/responses/{id}`: in this
process's memory, bounded by count and by size, oldest dropped first; nothing survives a restart.

Contract: `put(id, response, items)` keeps a response (the dict a client got) with the items of its
whole conversation (the chain before it, its input and its output), and `get(id)` returns both, or
None once it has been dropped or never was. Thread-safe: handler threads share one store.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

MAX_RESPONSES = 1000
MAX_BYTES = 64 << 20  # the JSON size of all that is kept


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, id: str, response: dict, items: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(items))
        if size > self.max_bytes:
            return  # larger than the whole store: never kept
        with self._lock:
            self._entries[id] = (response, items, size)
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def get(self, id: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            entry = self._entries.get(id)
        return None if entry is None else (entry[0], entry[1])

    def delete(self, id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(id, None)
            if entry is not None:
                self._bytes -= entry[2]
        return entry is not None
