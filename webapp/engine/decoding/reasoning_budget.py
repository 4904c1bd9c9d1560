"""A request's thinking budget: after that many tokens of thinking, the end-of-thinking marker is
forced, token by token, and the answer follows.

Contract: `ReasoningBudget(params)` where `params.reasoning_budget` is set (else the sampler makes
none); `forced()` is the token the next choice must be (a marker's next token), or None to sample as
usual; `record(token)` follows every chosen token. Thinking starts at the first output token where
the prompt opened it (`reasoning_open`: the template ended the prompt inside a think block, as
Qwen3's do) or after the output's own opening marker (`reasoning_markers[0]`), and ends at the
closing marker (`reasoning_markers[1]`), written by the model or forced; the budget counts the
tokens in between, so an answer that never thinks is never touched, and thinking happens once.
"""

from __future__ import annotations

from webapp.engine.decoding.sampling_params import SamplingParams


class ReasoningBudget:
    def __init__(self, params: SamplingParams):
        self.budget = params.reasoning_budget
        self.opening, self.closing = params.reasoning_markers
        self.thinking = params.reasoning_open
        self.done = False
        self.spent = 0
        self._forcing: list[int] = []
        self._tail: list[int] = []  # the last tokens, as long as the longer marker

    def forced(self) -> int | None:
        if not self._forcing and self.thinking and self.spent >= self.budget:
            self._forcing = list(self.closing)
        return self._forcing.pop(0) if self._forcing else None

    def record(self, token: int) -> None:
        if self.done:
            return
        self._tail = (self._tail + [token])[-max(len(self.opening), len(self.closing)) :]
        if not self.thinking:
            if self.opening and self._tail[-len(self.opening) :] == list(self.opening):
                self.thinking = True
            return
        self.spent += 1
        if self._tail[-len(self.closing) :] == list(self.closing):
            self.thinking, self.done, self._forcing = False, True, []
