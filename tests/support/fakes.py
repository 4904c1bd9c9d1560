"""Test doubles for the web layer and the engine: a byte tokenizer, a plain chat template and fake
model runners under the real `Engine`.

`FakeRunner` stands in for the model runner under the real `Engine` (see `webapp.engine.serving.runner.Runner`):
its logits make greedy sampling pick `next_token(last token fed)`, and a test can hold its steps
(`gate`) or make its decode steps fail (`fault`).

`FakeTokenizer` is byte-level: ids 0-255 are the UTF-8 bytes, so every multi-byte character and
every tag is split across tokens, plus BOS (256, "<s>") and EOS (257, "</s>").

`FakeModelEngines` makes a model set's engines: real engines over fake runners, one per model file.

`ScriptedRunner` is a `FakeRunner` that plays scripted replies (`Reply`), and `start_scripted_engine`
starts a real `Engine` over one: the web layer's fixture.

`ClockedRunner` is a `ScriptedRunner` whose steps take time on a settable `Clock` (the engine's, for the
pages' and /metrics' numbers), and which can hold the model thread after a given number of steps.
"""

from __future__ import annotations

import codecs
import collections
import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from webapp.engine.model.lanes import Want
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.loaded_model import LoadedModel
from webapp.engine.serving.request import Request
from webapp.engine.serving.runner import Part

BOS, EOS = 256, 257
SPECIALS = {BOS: "<s>", EOS: "</s>"}
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIALS.values()))
_SPECIAL_IDS = {text: i for i, text in SPECIALS.items()}


class _StreamDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        if token_id in SPECIALS:
            return self.flush() + SPECIALS[token_id]
        return self._utf8.decode(bytes([token_id]))

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


class FakeTokenizer:
    bos_id = BOS
    eos_id = EOS
    add_bos = True
    stop_ids = frozenset({EOS})
    special_ids = frozenset(SPECIALS)
    vocab_size = 258

    def token_bytes(self, token_id: int) -> bytes:
        return SPECIALS[token_id].encode() if token_id in SPECIALS else bytes([token_id])

    def encode(self, text: str, special: bool = True) -> list[int]:
        if not special:
            return list(text.encode())
        ids: list[int] = []
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            ids += text[pos : m.start()].encode()
            ids.append(_SPECIAL_IDS[m.group()])
            pos = m.end()
        return ids + list(text[pos:].encode())

    def decode(self, ids: list[int]) -> str:
        decoder = self.stream_decoder()
        return "".join(decoder.add(i) for i in ids) + decoder.flush()

    def stream_decoder(self) -> _StreamDecoder:
        return _StreamDecoder()


class FakeTemplateError(ValueError):
    """Stands in for webapp.engine.text.chat_template.TemplateError (also a ValueError)."""


class FakeChatTemplate:
    """Renders `<|role|>content` lines; content "!template-error" makes it raise like a template."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.source = ""  # the template's text, as ChatTemplate.source (a test sets one that writes <|channel|> for Harmony)
        self.think = False  # end the generation prompt with "<think>\n", as thinking templates do

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True, **extra) -> str:
        self.calls.append({"messages": messages, "tools": tools, "extra": extra})
        parts = [f"<|tools|>{json.dumps(tools)}\n"] if tools else []
        for m in messages:
            if m["content"] == "!template-error":
                raise FakeTemplateError("roles must alternate user/assistant")
            calls = "".join(json.dumps(c["function"]) for c in m.get("tool_calls", []))
            parts.append(f"<|{m['role']}|>{m['content']}{calls}\n")
        if add_generation_prompt:
            # as Qwen3's templates: thinking turned off renders an empty think block, closed
            thinks = self.think and extra.get("enable_thinking", True)
            parts.append("<|assistant|>" + ("<think>\n" if thinks else "<think>\n\n</think>\n\n" if self.think else ""))
        return "".join(parts)


@dataclass
class Reply:
    """What `ScriptedRunner` makes the model generate for one request: `tokens` are its outputs in
    order, then EOS; an exception among them is raised by that request's step (a model error).
    `forever` cycles the tokens until the request is cancelled or hits max_tokens; `delay` stretches
    each of its steps (seconds)."""

    tokens: list = field(default_factory=list)
    delay: float = 0.0
    forever: bool = False

    @classmethod
    def text(cls, text: str, eos: bool = True, **kw) -> Reply:
        return cls(list(text.encode()) + ([EOS] if eos else []), **kw)


class Clock:
    """A settable clock for code that takes one (`Engine(clock=...)`, `EngineMetrics(clock=...)`)."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def run_by_kind(runner, parts: list[Part]) -> list[np.ndarray]:
    """`Runner.run` for the fakes, through the one call a step of that kind makes: a prompt chunk
    alone (`prefill`, `prompt_logits` or `hidden_states` by what it wants), decode lanes alone
    (`decode`, or `decode_drafted` where any drafted), or a mixed step (`prefill_and_decode`, or
    `prefill_and_verify`), so a test can record, hold or break each kind of step."""
    prompts, decoding = [p for p in parts if not p.decoding], [p for p in parts if p.decoding]
    batch, positions, drafts = [p.request for p in decoding], [p.start for p in decoding], [p.drafts for p in decoding]
    if prompts and (decoding or len(prompts) > 1):
        chunks = [(p.request, p.tokens, p.start) for p in prompts]
        if any(drafts):
            firsts, rows = runner.prefill_and_verify(chunks, batch, drafts, positions)
        else:
            firsts, rows = runner.prefill_and_decode(chunks, batch, positions)
        return [*firsts, *rows]
    if prompts:
        part = prompts[0]
        call = {Want.LAST: "prefill", Want.TOKEN: "prefill", Want.ALL: "prompt_logits", Want.HIDDEN: "hidden_states"}[part.want]
        return [getattr(runner, call)(part.request, part.tokens, part.start)]
    if any(drafts):
        return list(runner.decode_drafted(batch, drafts, positions))
    return list(runner.decode(batch, positions))


class FakeRunner:
    """A runner without a model: each logits row is one-hot at `next_token(last token fed)`
    ((token + 1) % vocab unless given), so greedy sampling is predictable.

    `gate` (set at first) holds every prefill and decode step while it is clear; `fault`, when set,
    is raised by every decode step (an `Exception` fails the step's requests, a `BaseException`
    kills the model thread); `step_s` stretches each decode step. `calls` records every step:
    ("prefill", request id, start, n tokens), ("copy", request id, source slot, length) and
    ("decode", request ids); with `mixes`, prompt chunks run with a decode step are ("mixed", ((request id,
    start, n tokens), ...), the decoding request ids), and with drafts too ("mixed drafted", the same,
    the drafts).
    """

    def __init__(
        self,
        vocab: int = 50,
        next_token: Callable[[int], int] | None = None,
        step_s: float = 0.0,
        mixes: bool = False,
        speculates: bool = False,
        draft=None,
    ):
        self.mixes = mixes
        self.speculates = speculates  # `decode_drafted`: every fed token's logits, as decode gives them
        self.draft = draft  # a DraftModel (over FakeSteps in the tests), or None
        self.drafted_limit = None
        self.verify_seconds = None  # the linear cost model (decoding/drafts.py LANE_COST)
        self.vocab = vocab
        self.next_token = next_token or (lambda last: (last + 1) % vocab)
        self.step_s = step_s
        self.gate = threading.Event()
        self.gate.set()
        self.fault: BaseException | None = None
        self.calls: list[tuple] = []

    def run(self, parts: list[Part]) -> list[np.ndarray]:
        return run_by_kind(self, parts)

    def _logits(self, last: int) -> np.ndarray:
        row = np.zeros(self.vocab, dtype=np.float32)  # (vocab,)
        row[self.next_token(last)] = 1.0
        return row

    def warm_up(self, progress) -> float:
        return 0.0

    def prefill(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        self.gate.wait(30)
        self.calls.append(("prefill", request.id, start, len(tokens)))
        return self._logits(tokens[-1])

    def prompt_logits(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        self.gate.wait(30)
        self.calls.append(("prompt_logits", request.id, start, len(tokens)))
        return np.stack([self._logits(t) for t in tokens])  # (T, vocab)

    def hidden_states(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """(T, 4): token t at position p is (t, p, 1, 0), so pooling is easy to check."""
        self.gate.wait(30)
        self.calls.append(("hidden", request.id, start, len(tokens)))
        return np.array([[t, start + i, 1.0, 0.0] for i, t in enumerate(tokens)], dtype=np.float32)

    def copy_prefix(self, request: Request, source_slot: int, length: int) -> None:
        self.calls.append(("copy", request.id, source_slot, length))

    def kept(self, request: Request, lanes: int) -> None:
        pass

    def ready(self, request: Request) -> bool:
        return True  # no images: a fake model has no projector

    def encode(self, waiting, alone: bool = False) -> None:
        pass

    def decode_drafted(self, batch: list[Request], drafts: list[list[int]], positions: list[int]) -> list[np.ndarray]:
        assert self.speculates
        if self.fault is not None:
            raise self.fault
        self.gate.wait(30)
        self.calls.append(("drafted", tuple(r.id for r in batch), tuple(tuple(d) for d in drafts)))
        return [np.stack([self._logits(t) for t in [r.output_ids[-1], *d]]) for r, d in zip(batch, drafts, strict=True)]

    def decode(self, batch: list[Request], positions: list[int]) -> np.ndarray:
        if self.fault is not None:
            raise self.fault
        self.gate.wait(30)
        if self.step_s:
            time.sleep(self.step_s)  # a model step takes time; lets requests overlap
        self.calls.append(("decode", tuple(r.id for r in batch)))
        return np.stack([self._logits(r.output_ids[-1]) for r in batch])  # (B, vocab)

    def prompt_calls(self) -> list[tuple]:
        """`calls`' prompt work in order: copies, and each prompt chunk as ("prefill", request id, start,
        n tokens), whether it ran alone or in a mixed step."""
        flat = []
        for call in self.calls:
            if call[0] == "mixed":
                flat += [("prefill", *chunk) for chunk in call[1]]
            elif call[0] in ("prefill", "copy"):
                flat.append(call)
        return flat

    def prefill_and_decode(self, chunks: list[tuple[Request, list[int], int]], batch: list[Request], positions: list[int]):
        assert self.mixes
        if self.fault is not None:
            raise self.fault
        self.gate.wait(30)
        prompts = tuple((r.id, start, len(tokens)) for r, tokens, start in chunks)
        self.calls.append(("mixed", prompts, tuple(r.id for r in batch)))
        rows = [self._logits(r.output_ids[-1]) for r in batch]
        return [self._logits(tokens[-1]) for _, tokens, _ in chunks], np.stack(rows) if rows else np.zeros((0, self.vocab), np.float32)

    def prefill_and_verify(self, chunks, batch: list[Request], drafts: list[list[int]], positions: list[int]):
        assert self.mixes and self.speculates
        if self.fault is not None:
            raise self.fault
        self.gate.wait(30)
        prompts = tuple((r.id, start, len(tokens)) for r, tokens, start in chunks)
        self.calls.append(("mixed drafted", prompts, tuple(r.id for r in batch), tuple(tuple(d) for d in drafts)))
        rows = [np.stack([self._logits(t) for t in [r.output_ids[-1], *d]]) for r, d in zip(batch, drafts, strict=True)]
        return [self._logits(tokens[-1]) for _, tokens, _ in chunks], rows


class ScriptedRunner(FakeRunner):
    """A FakeRunner over the byte tokenizer that plays each request a script: the next queued `Reply`
    (or `default_reply`), taken at the request's first step. Its `tokens` are the request's outputs in
    order (cycled with `forever`, EOS past their end), each one's row `LEAD` above the rest, so any
    sampling picks it; an exception among them is raised by that request's step, failing it as a
    model error would; `delay` stretches each of its steps. A scored prompt's rows pick each next
    prompt token the same way, and an embedding's rows are FakeRunner's. A real engine finishes,
    caches and queues by its own rules. `requests` are the requests it has been asked to run, in the
    order of their first steps, recorded before `gate` holds the step."""

    LEAD = 30.0  # how far a picked token's logit stands above every other one

    def __init__(self):
        super().__init__(vocab=FakeTokenizer.vocab_size)
        self.replies: collections.deque[Reply] = collections.deque()
        self.default_reply = Reply.text("Hello from the fake engine.")
        self._scripts: dict[str, Reply] = {}
        self.requests: list[Request] = []

    @classmethod
    def picked_logprob(cls) -> float:
        """The logprob a picked token's row gives it: log(1 / (1 + (vocab - 1) * e^-LEAD))."""
        return -math.log1p((FakeTokenizer.vocab_size - 1) * math.exp(-cls.LEAD))

    def _pick(self, token: int) -> np.ndarray:
        row = np.full(self.vocab, -self.LEAD, dtype=np.float32)  # (vocab,)
        row[token] = 0.0
        return row

    def _script(self, request: Request) -> Reply:
        reply = self._scripts.get(request.id)
        if reply is None:
            reply = self._scripts[request.id] = self.replies.popleft() if self.replies else self.default_reply
            self.requests.append(request)
        return reply

    def _next(self, request: Request) -> np.ndarray:
        reply = self._script(request)
        if reply.delay:
            time.sleep(reply.delay)
        n, tokens = len(request.output_ids), reply.tokens
        token = tokens[n % len(tokens)] if reply.forever else tokens[n] if n < len(tokens) else EOS
        if isinstance(token, BaseException):
            raise token
        return self._pick(token)

    def prefill(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        self._script(request)
        super().prefill(request, tokens, start)
        return self._next(request)

    def prompt_logits(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        self._script(request)
        super().prompt_logits(request, tokens, start)
        rows = [self._pick(t) for t in request.prompt_ids[start + 1 : start + 1 + len(tokens)]]
        if len(rows) < len(tokens):  # the prompt's last chunk: its last row starts the script
            rows.append(self._next(request))
        return np.stack(rows)  # (T, vocab)

    def hidden_states(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        self._script(request)
        return super().hidden_states(request, tokens, start)

    def decode(self, batch: list[Request], positions: list[int]) -> np.ndarray:
        for request in batch:
            self._script(request)
        super().decode(batch, positions)
        return np.stack([self._next(r) for r in batch])  # (B, vocab)


class ClockedRunner(ScriptedRunner):
    """A ScriptedRunner on a test's `Clock` (give the engine the same one): each model step takes
    `step_s` of it, its tokens coming at its end. With `steps` set, that many more steps run, then
    the model thread holds at `gate` in the next one (`held` is set; that pass has published) until
    the test sets the gate."""

    def __init__(self, clock: Clock, step_s: float):
        super().__init__()
        self.clock, self.clock_step = clock, step_s  # not FakeRunner.step_s, which sleeps
        self.steps: int | None = None
        self.held = threading.Event()

    def run(self, parts: list[Part]) -> list[np.ndarray]:
        if self.steps is not None:
            self.steps -= 1
            if self.steps < 0:
                self.steps = None
                self.gate.clear()
                self.held.set()
        outputs = super().run(parts)
        self.clock.now += self.clock_step
        return outputs


def start_scripted_engine(
    max_context: int = 4096,
    slots: int = 4,
    held: threading.Event | None = None,
    runner: ScriptedRunner | None = None,
    **settings,
) -> Engine:
    """A started real `Engine` over a `ScriptedRunner` (its `loaded.runner`; `runner`, or a new one):
    loaded when returned, or with `held`, loading until that event is set. `settings` are the
    engine's own (queue_limit, clock, ...)."""

    def load() -> LoadedModel:
        if held is not None:
            held.wait(10)
        return LoadedModel(runner or ScriptedRunner(), FakeTokenizer(), FakeChatTemplate(), "fake-model", max_context, "FAKE")

    engine = Engine(load, slots=slots, **settings).start()
    if held is None:
        engine.settled.wait(10)
    return engine


class FakeModelEngines:
    """A model set's `make_engine` for tests: real engines over fake runners with the byte tokenizer,
    one per path asked for (`made`); a path in `broken` fails to load, one in `held` loads once its
    event is set. Each counts 1 byte of KV cache a token, so a footprint is easy to reckon."""

    def __init__(self, context: int = 64):
        self.context = context
        self.made: list[str] = []
        self.broken: set[str] = set()
        self.held: dict[str, threading.Event] = {}

    def __call__(self, path: str) -> Engine:
        self.made.append(path)

        def load():
            if path in self.held:
                self.held[path].wait(10)
            if path in self.broken:
                raise ValueError("not a GGUF")
            runner = FakeRunner(vocab=FakeTokenizer.vocab_size)
            name = path.rsplit("/", 1)[-1].removesuffix(".gguf")
            return LoadedModel(runner, FakeTokenizer(), FakeChatTemplate(), name, self.context, "FAKE", kv_bytes_per_token=1)

        return Engine(load, slots=1)


# --- sample tool definitions and model outputs (the API and output-text tests share them) ----------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
XML = (
    "Let me check.\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\n2024\n</parameter>\n</function>\n</tool_call>"
)
