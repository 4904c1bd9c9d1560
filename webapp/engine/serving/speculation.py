"""Speculative decoding's bookkeeping on the model thread: who drafts, each step's drafts within its
lane budget, and the server's recent answers that drafts are also looked up in.

Contract: `Speculation(enabled)`; `admit(request, runner)` gives a request its drafter
(decoding/drafts.py's PromptLookup) where speculation is on and the runner verifies drafts;
`drafts(batch, positions, context)` is each lane's draft for this step; `finished(request, reason)`
keeps a completed answer for later requests. How the drafted positions are sampled and which drafts
are kept is the engine's (`Engine._decode_drafted`): that is what keeps every output as plain
decoding gives it.
"""

from __future__ import annotations

from webapp.engine.decoding.drafts import MAX_NGRAM, PromptLookup, RecentOutputs
from webapp.engine.serving.request import FinishReason, Request

# a step's lanes with drafted tokens: on the default model here a step of 8 lanes costs ~2.5 one-lane
# steps, so drafts fill a small batch's step and leave a full one alone
DRAFTED_LANES = 12


class Speculation:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # read at admission: a request drafts, or not, for its whole life
        self.recent = RecentOutputs()

    def admit(self, request: Request, runner) -> None:
        if self.enabled and runner.speculates and request.pooling is None:
            request.drafter = PromptLookup(request.prompt_ids, self.recent)

    def drafts(self, batch: list[Request], positions: list[int], context: int) -> list[list[int]]:
        """Each lane's drafted tokens, within the step's lane budget (oldest first): speculation fills
        a step that has room, never one that the batch fills already, and never drafts past a
        request's max_tokens or the context (`positions`: where each lane's fed token goes)."""
        room, drafts = DRAFTED_LANES - len(batch), []
        for request, position in zip(batch, positions, strict=True):
            limit = min(room, request.params.max_tokens - len(request.output_ids) - 1, context - 2 - position)
            draft = request.drafter.propose(limit, len(batch)) if request.drafter is not None and limit > 0 else []
            room -= len(draft)
            drafts.append(draft)
        return drafts

    def finished(self, request: Request, reason: str) -> None:
        if request.drafter is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.recent.add(request.prompt_ids[-MAX_NGRAM:] + request.output_ids)
