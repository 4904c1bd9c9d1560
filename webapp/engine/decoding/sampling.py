"""Per-request sampling: a logits row in, the next token id (and its log-probabilities) out.

Contract: the engine makes one `RequestSampler(params, prompt_ids, constraint)` when a request is
admitted; only the model thread uses it. `choose(logits)` returns `(token, TokenLogprobs | None)`
for one (vocab,) row; where `picks_greedily`, a step may pick the argmax itself, and `picked(token)`
takes it as `choose` would have (`take(output)`: either, by what the step gave). Each request has
its own state (random generator from `seed`, token counts, grammar matcher) and nothing reads
another row, so a request samples the same tokens whatever shares its batched step: a constrained
request and free ones can run in one step.

The row goes through, in this order (as vLLM and Hugging Face do):
1. `logit_bias`: added to the named tokens' logits;
2. `repetition_penalty` (> 1 discourages): every token already in the prompt or the output has a
   positive logit divided by it and a negative one multiplied by it;
3. `frequency_penalty` and `presence_penalty` (OpenAI's): each token's logit drops by
   count * frequency_penalty + (count > 0) * presence_penalty, counting generated tokens only;
4. the grammar mask: tokens the request's constraint forbids get -inf;
5. greedy (argmax) at temperature 0, otherwise temperature, top-k, top-p, min-p (tokens below
   min_p times the most likely token's probability are dropped), then a draw.
Where a thinking budget is spent (`reasoning_budget.py`), the closing marker's tokens are taken
instead of any of this, one a choice.

Log-probabilities report the model's own distribution: the log-softmax of the raw row, before
any of the steps above (vLLM's default), so `logprobs` score what the model thinks, whatever
the request's sampling settings, and prompt scoring matches generation scoring.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from webapp.engine.decoding.reasoning_budget import ReasoningBudget
from webapp.engine.decoding.sampling_params import SamplingParams


class TokenLogprobs(NamedTuple):
    """The log-probability of one chosen token, and the `top` most likely (id, logprob) pairs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def token_logprobs(row: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """`token`'s log-probability under the raw logits `row`, with the `top` best alternatives."""
    logp = log_softmax(row)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = np.argpartition(-logp, top - 1)[:top]
        ids = ids[np.argsort(-logp[ids], kind="stable")]
        best = tuple((int(i), float(logp[i])) for i in ids)
    return TokenLogprobs(token, float(logp[token]), best)


def score_prompt(rows: np.ndarray, prompt_ids: list[int], start: int, top: int) -> list[TokenLogprobs]:
    """The prompt tokens after positions start.. scored, each under the row of the position before
    it: rows (n, vocab) of positions start..start + n - 1 (the prompt's last row scores nothing)."""
    following = prompt_ids[start + 1 : start + 1 + len(rows)]
    return [token_logprobs(row, token, top) for row, token in zip(rows, following)]


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a (vocab,) row: greedy at temperature 0, else temperature / top-k / top-p / min-p.

    Written for a 49,152-token row on the model thread, where every microsecond is paid per token
    per stream: the weights exp(x - max) come from float32 `exp` (NumPy vectorizes it; its float64
    `exp` was far slower on a whole row), the cuts sort only the candidates they can need, and the
    draw is one uniform number against the kept weights' running sums (a draw before and after, on
    the default model's rows: bench/RESULTS.md, sampling at a temperature)."""
    if params.temperature <= 0:
        return int(np.argmax(logits))
    x = np.array(logits, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        x /= np.float32(params.temperature)
    ids = None  # the kept tokens' ids where not every token is kept
    allowed = np.isfinite(x)
    if np.count_nonzero(allowed) != np.count_nonzero(np.isfinite(logits)):
        # a temperature so small that float32 cannot hold the scaled logits: sample as its limit does
        return int(np.argmax(logits))
    if not allowed.all():  # masked tokens never enter the cuts below
        ids = np.flatnonzero(allowed)
        x = x[ids]
    # logits scaled near float32's range (a tiny temperature) can lie further apart than float32 holds:
    # such a token's distance overflows to -inf, and its weight is the 0 it tends to
    with np.errstate(over="ignore"):
        weights = x - x.max()
    np.exp(weights, out=weights)  # relative to the most likely token
    keep = None
    if 0 < params.top_k < x.shape[0]:
        keep = _top_k(x, weights, params.top_k)
    if params.top_p < 1.0:
        keep = _top_p(x if keep is None else x[keep], weights if keep is None else weights[keep], params.top_p, keep)
    if keep is not None:
        weights = weights[keep]
        ids = keep if ids is None else ids[keep]
    if params.min_p > 0:
        kept = np.flatnonzero(weights >= params.min_p)
        weights = weights[kept]
        ids = kept if ids is None else ids[kept]
    drawn = _draw(weights, rng)
    return int(drawn if ids is None else ids[drawn])


def _candidate_sets(weights: np.ndarray):
    """Growing sets of positions: those whose weight is at least a threshold, the threshold falling
    step by step, then every position. Every position outside a set weighs less than every one
    inside, so a cut that a set satisfies is the cut of the whole row."""
    for floor in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-8, 1e-10, 1e-12):
        yield np.flatnonzero(weights >= floor)
    yield np.arange(weights.shape[0])


def _top_k(x: np.ndarray, weights: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest logits."""
    found = next(c for c in _candidate_sets(weights) if c.shape[0] >= k)
    return found[np.argpartition(-x[found], k - 1)[:k]]


def _top_p(x: np.ndarray, weights: np.ndarray, top_p: float, among: np.ndarray | None) -> np.ndarray:
    """Positions (in `among`'s terms, where given) of the smallest set of most likely tokens whose
    probability reaches `top_p`, at least one; ties in order of position, as a stable sort of the
    whole row orders them."""
    total = weights.sum(dtype=np.float64)
    for found in _candidate_sets(weights):
        head = found[np.argsort(-x[found], kind="stable")]
        mass = np.cumsum(weights[head], dtype=np.float64) / total
        if mass[-1] >= top_p or head.shape[0] == x.shape[0]:
            break
    head = head[: int(np.searchsorted(mass, top_p)) + 1]
    return head if among is None else among[head]


def _draw(weights: np.ndarray, rng: np.random.Generator, block: int = 1024) -> int:
    """A position drawn with probability proportional to its weight: one uniform number against the
    running sums, found block by block: the blocks' sums, then one block's running sums, where a
    float64 running sum of the whole row cost more (bench/RESULTS.md, figures moved out of code
    comments)."""
    n = weights.shape[0]
    if n <= block:
        sums = np.cumsum(weights, dtype=np.float64)
        return min(int(np.searchsorted(sums, rng.random() * sums[-1], side="right")), n - 1)
    whole = n - n % block
    block_sums = weights[:whole].reshape(-1, block).sum(axis=1, dtype=np.float64)
    if whole < n:
        block_sums = np.append(block_sums, weights[whole:].sum(dtype=np.float64))
    running = np.cumsum(block_sums)
    target = rng.random() * running[-1]
    b = min(int(np.searchsorted(running, target, side="right")), running.shape[0] - 1)
    within = np.cumsum(weights[b * block : (b + 1) * block], dtype=np.float64)
    target -= running[b - 1] if b else 0.0
    return b * block + min(int(np.searchsorted(within, target, side="right")), within.shape[0] - 1)


class RequestSampler:
    """One request's sampling state; see the module docstring."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], constraint=None):
        self.params = params
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.constraint = constraint
        self._prompt_ids = prompt_ids
        self._bias_ids = np.array([i for i, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float32)
        self._penalized = params.frequency_penalty != 0 or params.presence_penalty != 0
        self._counts: np.ndarray | None = None  # (vocab,) generated-token counts, when penalized
        self._seen: np.ndarray | None = None  # (vocab,) bool, prompt and output, for repetition_penalty
        # a grammar decides every token of a constrained output: no marker is forced into it
        budgeted = params.reasoning_budget is not None and params.reasoning_markers[1] and constraint is None
        self.reasoning = ReasoningBudget(params) if budgeted else None

    @property
    def picks_greedily(self) -> bool:
        """Whether a row's argmax is all it takes from the row: greedy, nothing adjusted, masked,
        forced or reported; a step may then pick on the device (`picked`) and read back no row."""
        plain = self.constraint is None and self.reasoning is None and not self.params.logprobs
        return plain and self.params.temperature <= 0 and not self._adjusts

    def picked(self, token: int) -> tuple[int, None]:
        """`choose` where the step picked `token`, a row's argmax, itself (`picks_greedily`)."""
        assert self.picks_greedily
        self._record(token, 0)
        return token, None

    def take(self, output: np.ndarray) -> tuple[int, TokenLogprobs | None]:
        """`choose` for a step's output: a logits row, or a TOKEN lane's pick (an int32 array (1,))."""
        return self.picked(int(output[0])) if output.dtype.kind == "i" else self.choose(output)

    @property
    def _adjusts(self) -> bool:
        return bool(self._bias_ids.size) or self._penalized or self.params.repetition_penalty != 1.0

    def adjusted(self, logits: np.ndarray) -> np.ndarray:
        """The row after logit_bias, penalties and the grammar mask (steps 1-4); a copy when changed."""
        params, x = self.params, logits
        if self._adjusts:
            x = logits.astype(np.float32, copy=True)
            if self._bias_ids.size:
                keep = self._bias_ids < x.shape[0]
                x[self._bias_ids[keep]] += self._bias[keep]
            if params.repetition_penalty != 1.0:
                seen = self._seen_mask(x.shape[0])
                v = x[seen]
                x[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
            if self._penalized and self._counts is not None:
                counts = self._counts[: x.shape[0]]
                x -= counts * np.float32(params.frequency_penalty) + (counts > 0) * np.float32(params.presence_penalty)
        if self.constraint is not None:
            x = np.where(self.constraint.allowed(x.shape[0]), x, np.float32(-np.inf))
        return x

    def choose(self, logits: np.ndarray) -> tuple[int, TokenLogprobs | None]:
        forced = self.reasoning.forced() if self.reasoning is not None else None
        if forced is not None:  # the thinking budget is spent: its closing marker, whatever the row says
            self._record(forced, logits.shape[0])
            return forced, token_logprobs(logits, forced, self.params.top_logprobs) if self.params.logprobs else None
        x = self.adjusted(logits)
        if self.constraint is not None and not np.isfinite(x).any():
            # the grammar allows nothing more, not even a stop token (a stopped matcher): end here
            token = min(self.params.stop_token_ids) if self.params.stop_token_ids else int(np.argmax(logits))
        else:
            token = sample(x, self.params, self.rng)
        self._record(token, logits.shape[0])
        logprobs = token_logprobs(logits, token, self.params.top_logprobs) if self.params.logprobs else None
        return token, logprobs

    def _record(self, token: int, width: int) -> None:
        if self.reasoning is not None:
            self.reasoning.record(token)
        if self._penalized:
            if self._counts is None:
                self._counts = np.zeros(width, dtype=np.float32)
            self._counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True
        if self.constraint is not None and token not in self.params.stop_token_ids:
            if not self.constraint.accept(token):
                raise RuntimeError(f"the grammar rejected token {token}: {self.constraint.error}")

    def _seen_mask(self, width: int) -> np.ndarray:
        if self._seen is None:
            self._seen = np.zeros(width, dtype=bool)
            ids = np.asarray(self._prompt_ids, dtype=np.int64)
            self._seen[ids[ids < width]] = True
        return self._seen
