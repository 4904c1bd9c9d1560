"""Sampling options beyond temperature and top-p, and log-probabilities in OpenAI's shapes.

Pure functions, no Flask. `parse_sampling_options(body, chat)` validates `presence_penalty`,
`frequency_penalty` (-2..2), `repetition_penalty` (> 0, up to 10), `min_p` (0..1), `logit_bias`
(token id -> -100..100, at most `MAX_LOGIT_BIAS` entries) and the log-probability fields: in chat
`logprobs` (bool) with `top_logprobs` (0..`MAX_TOP_LOGPROBS_CHAT`); in completions `logprobs`
(0..`MAX_TOP_LOGPROBS_COMPLETIONS`, the number of alternatives) and `echo`. Every refusal is an
`ApiError` 400 naming the field. What each option does is in webapp/engine/decoding/sampling.py.

The builders turn the engine's `TokenLogprobs` into the response fields: `chat_logprobs` gives a
choice's `{"content": [...], "refusal": None}` (token text, logprob, UTF-8 bytes, top
alternatives); `completion_logprobs` gives the legacy `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`, where the first echoed prompt token has no logprob (null);
`CompletionEcho` tracks which of a completion request's logprobs have been sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from webapp.openai.errors import ApiError
from webapp.openai.lora_choice import parse_lora
from webapp.openai.request_bodies import opt_bool, opt_int, opt_number

MAX_TOP_LOGPROBS_CHAT = 20  # OpenAI's limits
MAX_TOP_LOGPROBS_COMPLETIONS = 5
MAX_LOGIT_BIAS = 300


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False  # completions: the prompt comes back before the completion (with its logprobs)
    lora: tuple = ()  # llama-server's `lora`: ((adapter id or name, scale), ...) (lora_choice.py)

    def engine_fields(self) -> dict:
        """The matching SamplingParams fields."""
        return dict(
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            prompt_logprobs=self.top_logprobs if self.echo and self.logprobs else None,
        )


def parse_sampling_options(body: dict, chat: bool) -> SamplingOptions:
    body = {k: v for k, v in body.items() if v is not None}
    number = lambda key, low, high, default: _float(opt_number(body, key, low, high), default)  # noqa: E731
    repetition = number("repetition_penalty", 0.0, 10.0, 1.0)
    if repetition <= 0:
        raise ApiError(400, "'repetition_penalty' must be greater than 0.", "repetition_penalty")
    if chat:
        logprobs = opt_bool(body, "logprobs", False)
        top = opt_int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS_CHAT)
        if top is not None and not logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
        echo = False
    else:
        if isinstance(body.get("logprobs"), bool):  # some clients send chat's boolean here
            body["logprobs"] = 0 if body["logprobs"] else None
        top = opt_int(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS_COMPLETIONS)
        logprobs = top is not None
        echo = opt_bool(body, "echo", False)
    return SamplingOptions(
        min_p=number("min_p", 0.0, 1.0, 0.0),
        presence_penalty=number("presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=number("frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=repetition,
        logit_bias=_parse_logit_bias(body.get("logit_bias")),
        logprobs=logprobs,
        top_logprobs=top or 0,
        echo=echo,
        lora=parse_lora(body.get("lora")),
    )


def _float(value, default: float) -> float:
    return default if value is None else float(value)


def _parse_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must be an object mapping token ids to numbers.", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries.", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {key!r}.", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"'logit_bias[{key}]' must be a number from -100 to 100.", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def check_token_ids(options: SamplingOptions, vocab_size: int) -> None:
    """logit_bias may only name tokens of the served model's vocabulary."""
    for token, _ in options.logit_bias:
        if token >= vocab_size:
            raise ApiError(400, f"'logit_bias' names token {token}, outside the vocabulary (size {vocab_size}).", "logit_bias")


# --- response shapes ----------------------------------------------------------------------------


def _token_entry(tokenizer, token: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokenizer, entries) -> dict:
    """A chat choice's `logprobs` for these TokenLogprobs."""
    content = [
        {**_token_entry(tokenizer, e.token, e.logprob), "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, entries, offset: int = 0, first_token: int | None = None) -> dict:
    """A completion choice's legacy `logprobs`; `first_token` is an echoed prompt's first token,
    which has no logprob; `offset` is where the first entry's text starts in the choice's text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token: int, logprob, top) -> None:
        nonlocal offset
        text = tokenizer.token_bytes(token).decode("utf-8", errors="replace")
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)

    if first_token is not None:
        add(first_token, None, None)
    for e in entries:
        top = {tokenizer.token_bytes(t).decode("utf-8", errors="replace"): lp for t, lp in e.top}
        add(e.token, e.logprob, top)
    return out


class CompletionEcho:
    """A completion's echoed prompt and its logprobs (`echo`, `logprobs`), read once the engine
    has scored the prompt, i.e. once the request's first output or its end has arrived."""

    def __init__(self, tokenizer, req, prompt, options: SamplingOptions):
        self.tokenizer, self.request, self.options = tokenizer, req, options
        self.text = "" if not options.echo else prompt if isinstance(prompt, str) else tokenizer.decode(req.prompt_ids)
        self.sent = 0  # output tokens whose logprobs went out already (streaming)

    def logprobs(self, completion_tokens: int, offset: int = 0) -> dict | None:
        """Logprobs of the echoed prompt (when echoing) and of the output tokens not yet sent."""
        if not self.options.logprobs:
            return None
        req, entries, first = self.request, [], None
        if self.options.echo and self.sent == 0 and offset == 0:
            first, entries = req.prompt_ids[0], list(req.prompt_logprobs or [])
        entries += req.logprobs[self.sent : completion_tokens]
        self.sent = completion_tokens
        return completion_logprobs(self.tokenizer, entries, offset, first)
