"""The one request object that flows from an HTTP handler through the scheduler and back.

A handler builds a `Request` (prompt token ids plus `SamplingParams`, or a `pooling` for an
embedding), submits it to the engine and reads `Request.outputs`: the model thread puts generated token ids (ints) there, then exactly one
`Finished` marker, or an exception instance if the engine failed this request. The engine never sees
text: stop strings are matched on the handler side, which then calls `engine.abort(request)`.

How a request ends is one of `FINISH_REASONS`, the only list of them: the engine, the API and both
metrics views (the dashboard and /metrics) take it from here.
"""

from __future__ import annotations

import enum
import itertools
import queue
import time
from dataclasses import dataclass, field

from webapp.engine.decoding.sampling_params import SamplingParams

_ids = itertools.count(1)


class FinishReason:
    """Why a request ended (`Finished.reason`, `Request.finish_reason`)."""

    STOP = "stop"  # a stop token (or, on the handler side, a stop string)
    LENGTH = "length"  # max_tokens or the context is used up
    CANCELLED = "cancelled"  # aborted: the client went away or stopped reading
    SHUTDOWN = "shutdown"  # cancelled by a drain whose time ran out
    ERROR = "error"  # the engine failed this request's step


FINISH_REASONS = (
    FinishReason.STOP,
    FinishReason.LENGTH,
    FinishReason.CANCELLED,
    FinishReason.SHUTDOWN,
    FinishReason.ERROR,
)


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(frozen=True)
class Finished:
    """The last item a request's output queue ever carries."""

    reason: str  # one of FINISH_REASONS


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    outputs: queue.Queue = field(default_factory=queue.Queue)
    # where the prompt's chat messages end (the system prompt's, the one before the last user
    # message, the last one before the generation prompt), set by the web layer for a recurrent
    # model: its state is snapshotted there for a later prompt to start from (serving/state_snapshots.py)
    message_ends: tuple[int, ...] = ()
    # the prompt's images (webapp/engine/vision/vision.py's ImageSpan): their positions hold
    # placeholder ids past the vocabulary, and the steps feed the images' rows there
    images: tuple = ()
    # its LoRA adapter (serving/adapters.py's LoraUse), None: the model as it is
    lora: object = None

    # Owned by the model thread once submitted; handlers only read them after Finished.
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    # prompt tokens found in the slot's KV cache at admission, so not prefilled (OpenAI's usage
    # `cached_tokens`; a slot view's "reused_tokens")
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    slot: int | None = None
    preemptions: int = 0  # times the KV pool ran dry and it gave its blocks back, to be computed again
    # an embedding: the prompt's final norm outputs pooled so ("mean" or "last") into `embedding`
    # (float32, unnormalized) when its prefill ends, which ends the request; nothing is generated
    pooling: str | None = None
    embedding: object = None
    drafter: object = None  # its PromptLookup (webapp/engine/decoding/drafts.py) where the engine speculates
    drafted_tokens: int = 0  # tokens drafted for it, and how many of them its samples confirmed
    accepted_tokens: int = 0
    constraint: object = None  # a grammar's TokenConstraint (webapp/engine/decoding/constraints.py), set before submitting
    sampler: object = None  # the request's RequestSampler (webapp/engine/decoding/sampling.py), made at admission
    # Written by the model thread before the token (or the Finished) they describe is put on `outputs`.
    logprobs: list = field(default_factory=list)  # TokenLogprobs per output token, when params.logprobs
    prompt_logprobs: list | None = None  # TokenLogprobs per prompt token after the first, when asked
    finish_reason: str | None = None
    # Set by any thread; the model thread retires the request at its next step.
    cancel_reason: str | None = None

    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None

    @property
    def lineage(self) -> str | None:
        """What its cached K/V were computed with besides the model: its adapter's load, else None."""
        return None if self.lora is None else self.lora.lineage

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def resume_ids(self) -> list[int]:
        """What its cache holds before its next step: the prompt, and after a preemption the output
        but its last token (which the next step feeds)."""
        return self.prompt_ids + self.output_ids[:-1] if self.output_ids else self.prompt_ids

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's own tokens get logprobs (`prompt_logprobs`): every position's logits are needed."""
        return self.params.prompt_logprobs is not None

    @property
    def every_position(self) -> bool:
        """Whether every prompt position must be computed here (scoring, embeddings): none comes from
        a cache, and its chunks run alone."""
        return self.scores_prompt or self.pooling is not None

    def cancel(self, reason: str = FinishReason.CANCELLED) -> None:
        """Ask the engine to retire this request; safe from any thread, idempotent."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
