"""Forced tool calls at temperature 1: how many replies are calls whose arguments validate strictly.

Usage: .venv/bin/python bench/tool_calls.py [--tries 50] [--max-tokens 256] [--llama-server PATH]

Our server is started here on the default model (and, with `--llama-server`, llama.cpp's on the
same file with `--jinja`). Each server is asked the same question `--tries` times through the real
`openai` client (tool_choice "required", seeds 0..N-1) and the real `anthropic` client (tool_choice
{"type": "tool"}, the API's default temperature of 1), the tool's schema naming `city` and `unit` and
saying nothing of other properties. Each reply counts as:

  valid     one or more calls, every one's arguments valid with no property the schema never named
  cut       the token limit ended it before a whole call, and no markup reached the text
  invented  a call with a property the schema never named, or arguments that are not its JSON
  leaked    call markup (`<tool_call>`, `{"name": ...`) in the text
  no call   ended by itself without a call

and `parallel` counts the valid replies with more than one call (the APIs allow them by default).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys

import anthropic
import jsonschema
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servers import HOST, ROOT, exit_on_sigterm, start_llama_server, start_ours  # noqa: E402

sys.path.insert(0, ROOT)
from webapp.engine.serving.settings import default_model_path  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
STRICT = {**SCHEMA, "additionalProperties": False}
QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]
OUTCOMES = ("valid", "parallel", "cut", "invented", "leaked", "no call")


def outcome(calls: list, text: str, cut: bool) -> str:
    if "<tool_call>" in text or '{"name"' in text:
        return "leaked"
    try:
        for arguments in calls:
            jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, STRICT)
    except (ValueError, jsonschema.ValidationError):
        return "invented"
    if calls:
        return "valid"
    return "cut" if cut else "no call"


def ask_openai(url: str, tries: int, max_tokens: int) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": SCHEMA}}

    def one(seed: int) -> tuple[str, int]:
        choice = client.chat.completions.create(
            model="default", messages=QUESTION, tools=[tool], tool_choice="required", temperature=1.0, seed=seed, max_tokens=max_tokens
        ).choices[0]
        calls = [c.function.arguments for c in choice.message.tool_calls or []]
        return outcome(calls, choice.message.content or "", choice.finish_reason == "length"), len(calls)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(tries)))


def ask_anthropic(url: str, tries: int, max_tokens: int) -> list[tuple[str, int]]:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)
    tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}

    def one(_: int) -> tuple[str, int]:
        message = client.messages.create(
            model="default", max_tokens=max_tokens, messages=QUESTION, tools=[tool], tool_choice={"type": "tool", "name": "get_weather"}
        )
        calls = [b.input for b in message.content if b.type == "tool_use"]
        text = "".join(b.text for b in message.content if b.type == "text")
        return outcome(calls, text, message.stop_reason == "max_tokens"), len(calls)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(tries)))


def row(server: str, client: str, replies: list[tuple[str, int]]) -> str:
    counts = {k: sum(o == k for o, _ in replies) for k in OUTCOMES}
    counts["parallel"] = sum(o == "valid" and n > 1 for o, n in replies)
    return f"| {server} | {client} | " + " | ".join(str(counts[k]) for k in OUTCOMES) + " |"


def measure(name: str, url: str, args) -> list[str]:
    rows = []
    for client, ask in (("openai", ask_openai), ("anthropic", ask_anthropic)):
        try:
            rows.append(row(name, client, ask(url, args.tries, args.max_tokens)))
        except (openai.APIError, anthropic.APIError) as e:
            rows.append(f"| {name} | {client} | refused: {str(e)[:80]} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tries", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary, to ask it the same")
    args = parser.parse_args()
    exit_on_sigterm()
    rows = []
    with start_ours(env={"LLM_LOG_LEVEL": "warning"}) as ours:
        rows += measure("tinyserve", f"http://{HOST}:{ours.port}", args)
    if args.llama_server:
        with start_llama_server(args.llama_server, default_model_path(), parallel=2, extra=("--jinja",)) as theirs:
            rows += measure("llama-server", f"http://{HOST}:{theirs.port}", args)
    print(f"forced tool calls, {args.tries} tries a client, max_tokens {args.max_tokens}, temperature 1\n")
    print("| server | client | " + " | ".join(OUTCOMES) + " |")
    print("|---|---|" + "---|" * len(OUTCOMES))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
