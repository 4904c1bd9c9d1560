"""What a request asks of sampling: the settings `decoding/sampling.py` applies to each logits row.

Stdlib only and frozen: the web layer builds one per request from the API's fields, the request
carries it (`serving/request.Request.params`), and the model thread's sampler reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    # Tokens that end the request without being output (the tokenizer's end-of-turn ids; none when
    # the client asked for ignore_eos). The engine never puts one on `outputs`.
    stop_token_ids: frozenset[int] = frozenset()
    # what each one does, and in which order: webapp/engine/decoding/sampling.py
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False  # record each output token's logprob in Request.logprobs
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # score the prompt (Request.prompt_logprobs), with this many alternatives
    # thinking tokens before the end-of-thinking marker is forced (decoding/reasoning_budget.py; None:
    # no limit); the markers' token ids (opening, closing), and whether the prompt opened thinking
    reasoning_budget: int | None = None
    reasoning_markers: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    reasoning_open: bool = False
