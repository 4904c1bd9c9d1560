"""What a chat body asks of the model's reasoning: `chat_template_kwargs` (vLLM's, SGLang's and
llama-server's field: `{"enable_thinking": false}` for Qwen3's templates) and OpenAI's
`reasoning_effort`, as the variables the template is rendered with, and `reasoning_budget`, the
thinking tokens after which the end-of-thinking marker is forced.

Contract: `template_kwargs(body)` returns the extra variables (a dict, empty where the body asks for
none) and `reasoning_budget(body)` the budget (None: the server's, `LLM_REASONING_BUDGET`), or
they raise `ApiError` 400 naming the field. `reasoning_effort` ("none", "minimal", "low",
"medium" or "high") sets the two switches families read: `enable_thinking` (Qwen3 and its kin; off
for "none" and "minimal") and `reasoning_effort` (gpt-oss's, which knows low, medium and high: the
two lowest become low); a template that reads neither renders as before. `chat_template_kwargs`
values are whatever JSON holds and win over the effort's; they cannot replace the variables the
server sets itself. The template still renders in its sandbox: these are plain data.
"""

from __future__ import annotations

import json
from typing import Any

from webapp.openai.errors import ApiError

EFFORTS = ("none", "minimal", "low", "medium", "high")
# the variables the server renders every template with (webapp/engine/text/chat_template.py)
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"})
MAX_BYTES = 16384


def template_kwargs(body: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise ApiError(400, f"reasoning_effort is one of {', '.join(EFFORTS)}.", "reasoning_effort")
        out = {"enable_thinking": effort not in ("none", "minimal"), "reasoning_effort": effort if effort in EFFORTS[2:] else "low"}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return out
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs: an object of template variables is expected.", "chat_template_kwargs")
    for name in kwargs:
        if not name.isidentifier() or name in RESERVED:
            raise ApiError(
                400, f"chat_template_kwargs: {name!r} cannot be set (a name the server sets, or not a name).", "chat_template_kwargs"
            )
    if len(json.dumps(kwargs)) > MAX_BYTES:
        raise ApiError(400, f"chat_template_kwargs: at most {MAX_BYTES} bytes of JSON.", "chat_template_kwargs")
    return out | kwargs


def reasoning_budget(body: dict) -> int | None:
    budget = body.get("reasoning_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ApiError(400, "reasoning_budget: a whole number of tokens, 0 or more, is expected.", "reasoning_budget")
    return budget
