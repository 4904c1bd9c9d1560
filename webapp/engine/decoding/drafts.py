"""Drafted tokens for speculative decoding, from the request's own text (prompt lookup).

Contract: `PromptLookup(prompt_ids)` follows one request; `extend(tokens)` adds its accepted output
tokens, `propose(limit)` returns up to `limit` tokens that followed the latest earlier occurrence of
the sequence's last n tokens (n from MAX_NGRAM down to MIN_NGRAM), and `update(drafted, accepted)`
records how a proposal fared. Code edits, summaries, RAG answers and JSON repeat long spans of their
prompt, and a span that repeated once tends to go on repeating.

Drafts change no output: the engine samples every drafted position exactly as plain decoding would
and keeps a draft only while the sample equals it (webapp/engine/serving/engine.py). What a draft
costs is its lanes in the step, so `propose` drafts as many tokens as the request's recent
acceptance pays for: an average of the share of drafted tokens accepted, DRAFT_MAX when all are, none
below MIN_RATE (then, a little more each step, it tries again).
"""

from __future__ import annotations

MAX_NGRAM, MIN_NGRAM = 4, 2
DRAFT_MAX = 8
MIN_RATE = 0.15  # below this acceptance rate, no draft (retried as the rate recovers)
RECOVERY = 0.02  # per undrafted step
MEMORY = 0.3  # the weight of the latest proposal in the acceptance average


class PromptLookup:
    def __init__(self, prompt_ids: list[int]):
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._previous: dict[tuple[int, ...], int] = {}  # the occurrence before that one
        self.rate = 0.5
        self.extend(prompt_ids)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    gram = tuple(self.tokens[end - n : end])
                    if gram in self._last:
                        self._previous[gram] = self._last[gram]
                    self._last[gram] = end

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens (fewer as acceptance is lower) that followed the last n-gram before."""
        limit = min(limit, round(1 + (DRAFT_MAX - 1) * self.rate))
        if self.rate < MIN_RATE or limit <= 0:
            self.rate += RECOVERY
            return []
        end = len(self.tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if end < n:
                continue
            gram = tuple(self.tokens[end - n :])
            after = self._previous.get(gram)  # _last[gram] is the sequence's own end
            if after is not None:
                return self.tokens[after : after + limit]
        return []

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.rate = (1 - MEMORY) * self.rate + MEMORY * accepted / drafted
