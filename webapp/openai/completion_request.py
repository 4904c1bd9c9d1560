"""A (legacy) completion body, parsed once into the typed request the generation path takes.

Contract: `parse_completion(body)` validates an OpenAI `/v1/completions` body and returns a frozen
`CompletionRequest`: its parameters (`request_bodies`: the prompt, as text or token ids, echo,
the counts) and its sampling options (`sampling_options`). Every refusal is an `ApiError` 400,
raised here, before anything is tokenized or submitted. Pure Python: no Flask, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from webapp.openai.request_bodies import CompletionParams, parse_completion_request
from webapp.openai.sampling_options import SamplingOptions, parse_sampling_options


@dataclass(frozen=True)
class CompletionRequest:
    params: CompletionParams
    options: SamplingOptions


def parse_completion(body: dict) -> CompletionRequest:
    return CompletionRequest(parse_completion_request(body), parse_sampling_options(body, chat=False))
