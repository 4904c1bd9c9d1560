"""Renders a model's Jinja chat template (GGUF `tokenizer.chat_template`) into prompt text.

Contract:
- `ChatTemplate(source, bos_token, eos_token)` compiles the template once; an empty or missing
  source means the built-in ChatML template. A syntax error raises `TemplateError` here, at
  construction, not on the first request.
- `render(messages, tools=None, add_generation_prompt=True, **extra)` returns the prompt text. The
  template sees `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token` and `extra`,
  the same names Hugging Face's `apply_chat_template` passes. A message whose content is a list of
  `{"type": "text", "text": ...}` parts is flattened to one string (parts joined by "\\n") first,
  because most templates concatenate `message['content']` as a string.
- Templates come from model files, so they are untrusted: they run in Jinja's immutable sandbox
  (no dunder access, no mutation of the caller's lists and dicts). Every failure, including the
  template's own `raise_exception(...)`, surfaces as `TemplateError`, a ValueError, so the web layer
  can answer it with a 400 rather than a 500.
- Pure Python (jinja2): no tinygrad, no Flask. A ChatTemplate is immutable and thread-safe.
"""

from __future__ import annotations

import datetime
import json
from typing import NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# Used when the model file has no template: ChatML is what SmolLM2, Qwen and many others speak.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """The chat template could not be compiled or rendered for these messages."""


class _GenerationTag(Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` (it marks assistant text for training
    masks) and renders its body unchanged, so templates that use it still compile."""

    tags = frozenset({"generation"})

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Undefined(jinja2.Undefined):
    """A missing name or key, as Jinja's own (printed as nothing; `is defined` false), except that `+`
    with a string gives the string: gpt-oss's template writes `"// " + tool.description` for every
    tool, and OpenAI's API lets a tool leave its description out (llama.cpp's renderer reads that as
    the empty string too)."""

    def __add__(self, other):
        return other if isinstance(other, str) else super().__add__(other)

    def __radd__(self, other):
        return other if isinstance(other, str) else super().__radd__(other)


def _raise_exception(message) -> NoReturn:
    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' ; templates are written against HF's, which doesn't.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _flatten_content(content):
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise TemplateError(f"unsupported message content part {kind!r}: only text parts are supported")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _build_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, autoescape=False, undefined=_Undefined, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template plus the BOS/EOS strings it may reference; see the module docstring."""

    def __init__(self, source: str | None, bos_token: str, eos_token: str):
        self.source = source or CHATML_TEMPLATE
        self.is_builtin = not source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _build_environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True, **extra) -> str:
        messages = [
            {**m, "content": _flatten_content(m["content"])} if isinstance(m, dict) and isinstance(m.get("content"), list) else m
            for m in messages
        ]
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(variables)
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(f"chat template attempted an unsafe operation: {e}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # the template is data from a model file; its TypeErrors are not our bugs
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
