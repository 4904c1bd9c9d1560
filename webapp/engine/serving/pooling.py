"""An embedding request's pooling: its prompt chunks' final norm outputs folded into one vector.

Contract: `add(request, rows, start)` takes a chunk's rows (T, dim) from position `start`;
`finish(request)` leaves `request.embedding` as the pooled float32 vector (unnormalized: the API
scales it). "mean" keeps a float64 sum until the whole prompt is in; "last" the latest row; "first"
position 0's. "rank" keeps the latest row too, and `finish(request, ranker)` leaves the reranker's
score of it (a float) in `request.embedding` instead (serving/ranker.py).
"""

from __future__ import annotations

import numpy as np

from webapp.engine.serving.request import Request


def add(request: Request, rows: np.ndarray, start: int) -> None:
    if request.pooling in ("last", "rank"):
        request.embedding = rows[-1].astype(np.float32)
    elif request.pooling == "first":
        if start == 0:
            request.embedding = rows[0].astype(np.float32)
    else:
        total = rows.sum(axis=0, dtype=np.float64)
        request.embedding = total if request.embedding is None else request.embedding + total


def finish(request: Request, ranker=None) -> None:
    if request.pooling == "rank":
        request.embedding = ranker.score(request.embedding)
    elif request.pooling == "mean":
        request.embedding = (request.embedding / request.prompt_len).astype(np.float32)
