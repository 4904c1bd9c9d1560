"""Speculative decoding's bookkeeping on the model thread: who drafts, each step's drafts within its
lane budget, and the server's recent answers that drafts are also looked up in.

Contract: `Speculation(enabled)`; `admit(request, runner)` gives a request its drafter (a
`Drafter`: decoding/drafts.py's PromptLookup, and the runner's draft model where one is loaded and
`use_draft_model`) where speculation is on and the runner verifies drafts; `drafts(batch, positions,
loaded)` is each lane's draft for this step, the draft model's asked for in one batched call;
`finished(request, reason)` keeps a completed answer for later requests. How the drafted positions
are sampled and which drafts are kept is the engine's (`Engine._decode_drafted`): that is what keeps
every output as plain decoding gives it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from webapp.engine.decoding.drafts import MAX_NGRAM, PromptLookup, RecentOutputs, StepCosts
from webapp.engine.serving.draft_model import Drafter
from webapp.engine.serving.request import FinishReason, Request

log = logging.getLogger(__name__)

# a step's lanes with drafted tokens: a step of 8 lanes costs a few one-lane steps, not eight
# (bench/RESULTS.md, cheaper verification lanes), so drafts fill a small batch's step and leave a
# full one alone
DRAFTED_LANES = 12


class Speculation:
    def __init__(self, enabled: bool = True):
        # both read at admission: a request drafts, or not, and from which sources, for its whole life
        self.enabled = enabled
        self.use_draft_model = True  # where the runner has one (LLM_DRAFT_MODEL)
        self.measured_costs = True  # lanes priced by the runner's warm-up timings (False: LANE_COST each, for the bench)
        self.recent = RecentOutputs()
        self._costs_of, self._step_costs = None, StepCosts()

    def admit(self, request: Request, runner) -> None:
        if self.enabled and runner.speculates and request.pooling is None:
            # a draft model reads the prompt's tokens: an image's placeholders are none of its own
            draft = runner.draft if self.use_draft_model and not request.images else None
            request.drafter = Drafter(PromptLookup(request.prompt_ids, self.recent, self.costs(runner)), draft)

    def costs(self, runner) -> StepCosts:
        """What a step of n lanes costs on `runner` (its warm-up timings), which drafts are priced by."""
        if not self.measured_costs:
            return StepCosts()
        if self._costs_of is not runner:  # measured at the runner's warm-up
            self._costs_of, self._step_costs = runner, StepCosts(runner.verify_seconds)
        return self._step_costs

    def drafts(
        self, batch: list[Request], positions: list[int], loaded, sharing: int = 0, room: Callable[[Request], int | None] | None = None
    ) -> list[list[int]]:
        """Each lane's drafted tokens, within the step's lane budget (oldest first): speculation fills
        a step that has room, never one that the batch fills already, and never drafts past a
        request's max_tokens or the context (`positions`: where each lane's fed token goes).
        `sharing`: the requests that will decode beside these soon (prefilling or queued, in a step
        that prefills too): a drafted lane lengthens the prefill they wait on, and a token drafted
        now is one their shared steps would make cheaply later, so drafts must be as likely as in
        the step they will share (priced by the decoding lanes alone, a draft beside a 32-token chunk
        looked nearly free). `room(request)`: the positions its step may write, where a paged cache's
        blocks bound them (None: the context does)."""
        lanes, drafts, asks, drafted = DRAFTED_LANES - len(batch), [], [], 0
        if loaded.runner.drafted_limit is not None:  # a recurrent model's draft rows
            lanes = min(lanes, loaded.runner.drafted_limit)
        for request, position in zip(batch, positions, strict=True):
            limit = min(lanes, request.params.max_tokens - len(request.output_ids) - 1, loaded.context - 2 - position)
            blocks = room(request) if room is not None else None
            if blocks is not None:
                limit = min(limit, blocks - position - 1)
            sharers = max(len(batch), sharing)
            draft, ask = request.drafter.plan(limit, sharers, drafted) if request.drafter is not None and limit > 0 else ([], 0)
            lanes -= len(draft) + ask
            drafted += len(draft) + ask
            if ask:
                asks.append((len(drafts), request, ask))
            drafts.append(draft)
        if asks:
            for (i, _, _), draft in zip(asks, self._from_draft_model(loaded.runner.draft, asks)):
                drafts[i] = draft
        return drafts

    def _from_draft_model(self, draft, asks: list[tuple[int, Request, int]]) -> list[list[int]]:
        """The draft model's tokens for each ask; none if its step failed (a draft never fails a request)."""
        try:
            return draft.continue_greedy([(r.slot, r.prompt_ids + r.output_ids, k) for _, r, k in asks])
        except Exception:
            log.warning("the draft model's step failed; this step decodes without its drafts", exc_info=True)
            return [[] for _ in asks]

    def finished(self, request: Request, reason: str) -> None:
        if request.drafter is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.recent.add(request.prompt_ids[-MAX_NGRAM:] + request.output_ids)
