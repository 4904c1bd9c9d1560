"""A chat body, parsed once into the typed request the generation path takes.

Contract: `parse_chat(body, max_messages, fetch)` validates an OpenAI chat body (the one
`/v1/chat/completions` receives, or the one Anthropic's Messages and OpenAI's Responses bodies are
translated into) and returns a frozen `ChatRequest`: its parameters (`request_bodies`), its
sampling options (`sampling_options`), the grammar its output must follow (`structured`),
whether more than one tool call may come back, the template's extra variables and the thinking
budget (`reasoning_controls`) and the images' bytes (`images`). Every refusal is an `ApiError` 400, raised here,
before anything is rendered or submitted. Pure Python: no Flask, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from webapp.openai import images, structured
from webapp.openai.reasoning_controls import reasoning_budget, template_kwargs
from webapp.openai.request_bodies import ChatParams, parse_chat_request
from webapp.openai.sampling_options import SamplingOptions, parse_sampling_options


@dataclass(frozen=True)
class ChatRequest:
    params: ChatParams
    options: SamplingOptions
    grammar: str | None  # None: free output
    parallel: bool  # more than one tool call may come back
    template_kwargs: dict  # extra variables for the chat template (reasoning_controls.py)
    reasoning_budget: int | None  # thinking tokens before the end-of-thinking marker is forced (None: the server's)
    images: tuple[bytes, ...] = ()  # in the order of their markers in the messages (images.IMAGE_MARKER)


def parse_chat(body: dict, max_messages: int, fetch=None) -> ChatRequest:
    """`fetch`: what fetches an http(s) image URL (image_fetch.ImageFetcher), where the operator allows it."""
    params = parse_chat_request(body, max_messages)
    options = parse_sampling_options(body, chat=True)
    parallel = structured.parallel_tool_calls(body)
    grammar = structured.output_grammar(body, params.active_tools, params.tool_choice, params.forced_tool, parallel)
    pictures = images.chat_images(body["messages"], fetch)
    return ChatRequest(params, options, grammar, parallel, template_kwargs(body), reasoning_budget(body), pictures)
