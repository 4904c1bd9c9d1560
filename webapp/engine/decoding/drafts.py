"""Drafted tokens for speculative decoding, from the request's own text (prompt lookup) and from the
server's recent answers.

Contract: `PromptLookup(prompt_ids, recent, costs)` follows one request; `extend(tokens)` adds its accepted
output tokens, `propose(limit)` returns up to `limit` tokens that followed the latest earlier
occurrence of the sequence's last n tokens (n from MAX_NGRAM down to MIN_NGRAM) in its own text, else
in `recent` (a `RecentOutputs`: the last answers the server gave, where a repeated request finds its
earlier answer), and `update(drafted, accepted)` records how a proposal fared (its `Acceptance`,
which a draft model's drafts keep too: webapp/engine/serving/draft_model.py). Code edits, summaries,
RAG answers and JSON repeat long spans of their prompt, a span that repeated once tends to go on
repeating, and clients (retries, evaluations, agents re-asking) repeat whole requests.

Drafts change no output: the engine samples every drafted position exactly as plain decoding would
and keeps a draft only while the sample equals it (webapp/engine/serving/engine.py). What a draft
costs is its lanes in the step (`StepCosts`: the served model's verifications of 1..9 lanes, timed
at warm-up, else LANE_COST of a one-lane step a lane), plus the draft model's own step for each
token it drafts, so `Acceptance.length` drafts the length that makes the most tokens per unit of
step time at the source's recent per-token acceptance p: k drafts yield (1 - p^(k+1)) / (1 - p)
tokens for a step of k + 1 lanes, and a draft must beat none by MARGIN of the step's tokens. Below
some p a draft never pays; in a step of many sequences a lane costs more of each one's share, so
drafts must be likelier still. Undrafted steps raise p a little, so drafting is tried again (less
often in a step of more sequences).
"""

from __future__ import annotations

from collections import deque

import numpy as np

# the longest n-gram a draft's source is chosen by: among a sequence's earlier n-grams like its last
# ones, the longest match is likelier the passage being copied (a code edit's `self.items =` occurs
# twice in its file, and a short n-gram picks the later one while the model copies the first);
# bench/speculative_replay.py compares lengths on recorded outputs, bench/RESULTS.md has its figures
MAX_NGRAM, MIN_NGRAM = 8, 2
DRAFT_MAX = 8
# a drafted lane's cost, in one-lane steps, where no warm-up timed the lanes: the default model's
# verification of 8 lanes at position 32 as last measured (bench/RESULTS.md, the cheaper lanes' entry),
# (cost - 1) / 7; larger models read more weights a step, and lanes cost them less
LANE_COST = 0.22
# added to p per undrafted step, shared by the step's sequences: a retry costs lanes in a whole step,
# so in a step of b sequences one is retried b times less often (with a constant rise, a refused
# code edit beside other sequences was back at the p drafts ask for within a few steps, and its
# retries lengthened whole steps for little gain: bench/RESULTS.md, speculation at 8 streams)
RECOVERY = 0.02
# a draft must promise more tokens per unit of step time than none, by this share of the whole step:
# the cost model is off by a share of the whole step (one sequence's lanes timed at warm-up differ
# between starts, and a step of several sequences is not one sequence's), while a draft gains only
# its own sequence's share; so in a step of b sequences a draft must promise 1 + MARGIN * b times its
# sequence's tokens (a margin of the draft's own share alone broke even at 8 streams on average)
MARGIN = 0.05
MEMORY = 0.3  # the weight of the latest proposal in the acceptance average
# the most a draft is trusted: after a run of confirmed drafts the average nears 1, but a lookup's next
# token stays a guess (at 8 streams, code edits that had reached p ~1 drafted long beside other
# sequences, and fewer than half were confirmed); on recorded outputs, one stream loses nothing by it
SUREST = 0.95


class StepCosts:
    """A step's cost by its lanes, in one-lane steps: from `seconds`, the served model's verifications
    of 1, 2, .. lanes of one sequence timed at warm-up (past them, the last four lanes' slope), else
    1 + LANE_COST per lane after the first. Measured, a cost is what the kernels make of lanes: the
    first few lanes cost little more than one, then the cost climbs, and a ninth begins another pass
    over the weights (the kernels take eight tokens a pass), which a constant misjudges both ways; a
    Qwen3.5 lane also runs its own recurrence."""

    def __init__(self, seconds: list[float] | None = None):
        self.lanes = None
        if seconds:
            # noise only adds time: a width timed slower than a wider one was slowed by it, and costs
            # what the wider one does (a running maximum instead would carry one slowed width's time
            # over all wider ones, and make their lanes look free)
            fastest = [min(seconds[i:]) for i in range(len(seconds))]
            self.lanes = [t / fastest[0] for t in fastest]

    def step(self, lanes: int) -> float:
        if self.lanes is None:
            return 1 + LANE_COST * (lanes - 1)
        if lanes <= len(self.lanes):
            return self.lanes[lanes - 1]
        back = min(4, len(self.lanes) - 1)
        slope = (self.lanes[-1] - self.lanes[-1 - back]) / back if back else LANE_COST
        return self.lanes[-1] + slope * (lanes - len(self.lanes))

    def drafted(self, k: int, batch: int = 1, draft_cost: float = 0.0, before: int = 0) -> float:
        """k drafted tokens' cost against one sequence's share of a step of `batch` lanes: that share
        shrinks as batches grow, so a draft must be likelier to pay beside 7 other lanes than alone
        (tests/unit/test_drafts.py pins the thresholds). `before`: the lanes other sequences
        drafted in this step already, which these come after (two sequences drafting two each make a
        step of 6 lanes). `draft_cost`: what making a token costs besides its lane (a draft model's
        step), in one-lane steps."""
        start = batch + before
        return (self.step(start + k) - self.step(start) + draft_cost * k) * batch / self.step(batch)


LINEAR = StepCosts()


def gain(p: float, k: int, cost: float) -> float:
    """Expected tokens per unit of step time from k drafts at acceptance p, which cost `cost` (a
    share of the sequence's step) together."""
    p = min(max(p, 0.0), SUREST)
    return (1 - p ** (k + 1)) / (1 - p) / (1 + cost)


def draft_length(
    p: float, limit: int = DRAFT_MAX, batch: int = 1, draft_cost: float = 0.0, costs: StepCosts = LINEAR, before: int = 0
) -> int:
    """The k <= limit that maximizes expected tokens per step time, (1 - p^(k+1)) / (1 - p) over the
    step's cost with k drafted lanes (`StepCosts.drafted`), if it beats none by the margin a step of
    `batch` sequences asks (MARGIN)."""
    best, best_gain = 0, 1 + MARGIN * batch
    for k in range(1, limit + 1):
        if (g := gain(p, k, costs.drafted(k, batch, draft_cost, before))) > best_gain:
            best, best_gain = k, g
    return best


class Acceptance:
    """One source of drafts for one request: p, the chance that a drafted token is confirmed given the
    ones before it were, and the length that pays at p (`draft_cost`: what each drafted token costs
    to make besides its lane, in one-lane steps of the served model; nothing for prompt lookup;
    `costs`: the served model's `StepCosts`)."""

    def __init__(self, draft_cost: float = 0.0, costs: StepCosts = LINEAR):
        self.rate, self.draft_cost, self.costs = 0.5, draft_cost, costs

    def length(self, limit: int, batch: int = 1, before: int = 0) -> int:
        """How many tokens to draft now (at most `limit`); an undrafted step raises p a little (less in
        a larger `batch`)."""
        k = draft_length(self.rate, min(limit, DRAFT_MAX), batch, self.draft_cost, self.costs, before)
        if k <= 0:
            self.rate = min(1.0, self.rate + RECOVERY / batch)
        return k

    def gain(self, k: int, batch: int = 1, before: int = 0) -> float:
        return gain(self.rate, k, self.costs.drafted(k, batch, self.draft_cost, before))

    def update(self, drafted: int, accepted: int) -> None:
        """A proposal of `drafted` tokens had its first `accepted` confirmed: that many trials passed,
        and one more failed if it stopped short."""
        trials = accepted + (accepted < drafted)
        if trials:
            self.rate = (1 - MEMORY) * self.rate + MEMORY * accepted / trials


SEPARATOR = -1  # never a token: ends each text among the recent answers


def latest_repeat_end(text: np.ndarray, tail) -> int | None:
    """Where the latest occurrence in `text` of the longest of `tail`'s last MAX_NGRAM..MIN_NGRAM
    tokens that occurs ends, among occurrences that a token of the same text follows; else None.
    A scan, not an index: one comparison of the whole text finds where tail's last token occurs
    (followed by a token of its text), and each longer n-gram keeps those of the survivors that the
    token n - 1 before also matches, so it costs what the survivors number."""
    longest = min(MAX_NGRAM, len(tail), len(text) - 1)
    if longest < MIN_NGRAM:
        return None
    ends, found = np.flatnonzero((text[1:] != SEPARATOR) & (text[:-1] == tail[-1])), None  # occurrences' last tokens
    for n in range(2, longest + 1):
        ends = ends[ends >= n - 1]
        ends = ends[text[ends - (n - 1)] == tail[-n]]
        if ends.size == 0:
            break  # no longer n-gram occurs either
        if n >= MIN_NGRAM:
            found = int(ends[-1]) + 1
    return found


class RecentOutputs:
    """The server's last answers (each with the prompt tokens just before it), at most `capacity`
    tokens in all, oldest dropped first: end to end as int32, a SEPARATOR after each, scanned when a
    request finds no draft in its own text (an index of every n-gram in dicts took far more memory
    when full, and the model thread's time to add each answer: bench/RESULTS.md, prompt lookup's
    memory)."""

    def __init__(self, capacity: int = 65536):
        self.capacity, self.size = capacity, 0
        self._lengths: deque[int] = deque()  # each text's tokens, oldest first
        self._texts = np.zeros(0, np.int32)

    def add(self, tokens: list[int]) -> None:
        if not MIN_NGRAM < len(tokens) <= self.capacity:
            return
        self._lengths.append(len(tokens))
        self.size += len(tokens)
        dropped = 0
        while self.size > self.capacity:
            oldest = self._lengths.popleft()
            self.size -= oldest
            dropped += oldest + 1
        self._texts = np.concatenate([self._texts[dropped:], np.asarray(tokens, np.int32), np.array([SEPARATOR], np.int32)])

    def draft(self, tail, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest occurrence of `tail`'s last n tokens (the
        longest n that occurs) in a recent answer, within that answer."""
        end = latest_repeat_end(self._texts, tail)
        if end is None:
            return []
        piece = self._texts[end : end + limit]
        stops = np.flatnonzero(piece == SEPARATOR)
        return piece[: stops[0] if stops.size else len(piece)].tolist()


class PromptLookup(Acceptance):
    """The request's sequence as int32, 4 bytes a token, searched when a draft is asked for (a scan,
    cheap beside a step): an index of every n-gram in dicts took far more memory a prompt, and a
    system prompt shared by the pool's blocks was indexed again for each request (bench/RESULTS.md,
    prompt lookup's memory)."""

    def __init__(self, prompt_ids: list[int], recent: RecentOutputs | None = None, costs: StepCosts = LINEAR):
        super().__init__(costs=costs)
        self.recent = recent
        self._tokens = np.zeros(max(256, 2 * len(prompt_ids)), np.int32)
        self._size = 0
        self.extend(prompt_ids)

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self._size]

    def extend(self, tokens: list[int]) -> None:
        size = self._size + len(tokens)
        if size > len(self._tokens):
            grown = np.zeros(max(size, 2 * len(self._tokens)), np.int32)
            grown[: self._size] = self.tokens
            self._tokens = grown
        self._tokens[self._size : size] = tokens
        self._size = size

    def propose(self, limit: int, batch: int = 1, before: int = 0) -> list[int]:
        """Up to `limit` tokens (as many as acceptance pays for in a step of `batch` sequences, after
        `before` lanes drafted by others) that followed the last n-gram before."""
        limit = self.length(limit, batch, before)
        if limit <= 0:
            return []
        after = latest_repeat_end(self.tokens, self.tokens)
        if after is not None:
            return self.tokens[after : after + limit].tolist()
        return self.recent.draft(self.tokens[-MAX_NGRAM:], limit) if self.recent is not None else []
