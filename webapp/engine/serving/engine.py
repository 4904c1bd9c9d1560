"""The engine: the model thread's loop, and the thread-safe doors into it (submit, abort, health, stats).

Contract: `Engine.start()` loads the model and warms it up on a new thread, which from then on is
the only thread that touches tinygrad; `settled` is set once that has ended, loaded or failed.
Handler threads call `submit(request)` (non-blocking; raises `QueueFull` past the queue limit,
`EngineNotReady` while loading, `PromptTooLong` for a prompt that leaves no room in the context) and
read `request.outputs`; `abort(request)` retires a request within one engine step;
`on_model_thread(task)` runs `task(engine)` between steps and returns its result. An exception
while running a step fails only the requests in that step; the thread keeps serving. `health()` is
the watchdog: "error" when the model thread has died, "stalled" when one pass of its loop, with
work to do, has run for longer than `stall_seconds`. What `loader` returns, the real GGUF loader
and `build_engine` live in `webapp.engine.serving.loader`; settings in `webapp.engine.serving.settings`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from webapp.engine.decoding.constraints import GrammarCompiler
from webapp.engine.decoding.sampling import RequestSampler
from webapp.engine.serving import pooling
from webapp.engine.serving.errors import EngineNotReady, ModelLoadFailed, QueueFull, completion_room
from webapp.engine.serving.kv_cache import SlotTable
from webapp.engine.serving.loaded_model import LoadedModel
from webapp.engine.serving.metrics import REJECTED, EngineMetrics
from webapp.engine.serving.prefix_store import PrefixStore
from webapp.engine.serving.request import Finished, FinishReason, Request, Status
from webapp.engine.serving.runner import Part
from webapp.engine.serving.scheduler import PromptChunk, Scheduler
from webapp.engine.serving.settings import ENGINE_DEFAULTS
from webapp.engine.serving.speculation import Speculation

log = logging.getLogger(__name__)

PUBLISH_EVERY_S = 0.2


def _loaded(name: str, doc: str | None = None) -> property:
    return property(lambda engine: getattr(engine._require(), name), doc=doc)


class Engine:
    def __init__(
        self,
        loader: Callable[[], LoadedModel],
        slots: int = ENGINE_DEFAULTS["SLOTS"],
        queue_limit: int = ENGINE_DEFAULTS["QUEUE_LIMIT"],
        prefill_chunk: int = ENGINE_DEFAULTS["PREFILL_CHUNK"],
        stall_seconds: float = ENGINE_DEFAULTS["STALL_SECONDS"],
        speculate: bool = True,
        prefix_store: PrefixStore | None = None,
        clock: Callable[[], float] = time.monotonic,  # times admissions, tokens, finishes, metrics, publishes; not the watchdog
    ):
        self.loader = loader
        self.prefix_store = prefix_store  # a paged cache's filed blocks kept across restarts (LLM_PREFIX_CACHE_DIR)
        self.n_slots, self.queue_limit, self.prefill_chunk = slots, queue_limit, prefill_chunk
        self.stall_seconds, self.clock = stall_seconds, clock
        self.speculation = Speculation(speculate)  # where the runner can verify drafts (Runner.speculates)
        self._busy_since: float | None = None  # when the loop's current pass began; None asleep on the inbox
        self.state, self.error = "loading", None
        self.settled = threading.Event()  # loading has ended, loaded or failed (serving/model_set.py waits on it)
        self.loaded: LoadedModel | None = None
        self._grammars: GrammarCompiler | None = None
        self.scheduler = Scheduler(SlotTable(slots), prefill_chunk, clock)
        self.metrics = EngineMetrics({}, clock)
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting, self._rejected = 0, 0  # submitted, not yet admitted to a slot; refused at submit; guarded by _lock
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- doors for other threads ---------------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._run, name="model", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _require(self) -> LoadedModel:
        if self.state == "error":
            raise ModelLoadFailed(f"the model failed to load: {self.error}")
        if self.state != "ok" or self.loaded is None:
            raise EngineNotReady(f"the model is {self.state}" + (f": {self.error}" if self.error else ""))
        return self.loaded

    # the loaded model's parts, for handler threads (EngineNotReady while loading)
    tokenizer = _loaded("tokenizer")
    chat_template = _loaded("chat_template")
    vision = _loaded("vision", "the projector's side of images in prompts (vision/vision.py); None: no projector")
    ranker = _loaded("ranker", "a reranker file's head and prompt (serving/ranker.py); None: not a reranker")
    adapters = _loaded("adapters", "the LoRA adapters requests may choose (serving/adapters.py); None: none")
    pooling = _loaded("pooling", 'how embeddings pool the prompt ("mean", "last", "first"); Request.pooling takes it')
    embedding_suffix = _loaded("embedding_suffix", "token ids appended to every embedding input (the file's end-of-text, where it asks)")
    max_context = _loaded("context")

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles grammars against the served model's vocabulary, for handler threads."""
        loaded = self._require()
        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(loaded.tokenizer)
            return self._grammars

    @property
    def model_name(self) -> str:
        return self.loaded.name if self.loaded else "loading"

    @property
    def keeps_states(self) -> bool:
        """Whether the model keeps recurrent states, snapshotted where a request's messages end (Request.message_ends)."""
        return self._require().state_bytes > 0

    def submit(self, request: Request) -> None:
        loaded = self._require()
        if request.prompt_len == 0:
            raise ValueError("a request needs at least one prompt token")  # the API never sends one
        completion_room(request.prompt_len, loaded.context)  # raises PromptTooLong
        with self._lock:
            if self._waiting >= self.queue_limit:
                self._rejected += 1
                ttft = self.metrics.snapshot.get("ttft_p50_s") or 1.0  # the queue drains a request's time per slot round
                raise QueueFull(retry_after=max(1, int(ttft * self.queue_limit / max(self.n_slots, 1))))
            self._waiting += 1
        self._inbox.put(request)

    def on_model_thread(self, task: Callable[[Engine], object], timeout: float = 60.0):
        done: Future = Future()
        self._inbox.put((task, done))
        return done.result(timeout)

    def abort(self, request: Request) -> None:
        if request.status is not Status.FINISHED:
            request.cancel(FinishReason.CANCELLED)
            self._inbox.put(None)  # wake the model thread if it is idle

    def health(self) -> dict:
        snap = self.metrics.snapshot
        if self.state == "ok" and not (self._thread is not None and self._thread.is_alive()):
            return {"status": "error", "error": "the model thread has stopped"}
        busy_since = self._busy_since
        if self.state == "ok" and busy_since is not None and time.monotonic() - busy_since > self.stall_seconds:
            stuck = time.monotonic() - busy_since
            return {"status": "stalled", "model": self.model_name, "error": f"the model thread has not finished a step for {stuck:.0f} s"}
        body = {"status": self.state, "model": self.model_name} | ({"error": self.error} if self.error else {})
        if snap:
            body.update(running=snap["running"], queue_depth=snap["queue_depth"], slots_total=snap["slots_total"])
        return body

    def stats(self) -> dict:
        snap = self.metrics.current()  # rates and ages brought up to now, from the immutable snapshot
        if snap:
            snap["queue_depth"] = self._waiting  # live: the snapshot lags while a step runs
            snap["requests_total"] = {**snap["requests_total"], REJECTED: self._rejected}
            snap["state"] = self.state
            if self.loaded is not None and self.loaded.vision is not None:
                snap["images"] = self.loaded.vision.stats()
        return snap or {"state": self.state, "model": self.model_name}

    # --- the model thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            started = time.monotonic()
            loaded = self.loader()
            log.info("model %s loaded in %.1f s; warming up", loaded.name, time.monotonic() - started)
            warm = loaded.runner.warm_up(log.info)
            log.info("warm-up done in %.1f s; ready", warm)
            self.metrics = EngineMetrics(
                {"model": loaded.name, "context": loaded.context, "device": loaded.device, "prefill_chunk": self.prefill_chunk}
                | {"kv_type": loaded.kv_type, "kv_bytes_per_token": loaded.kv_bytes_per_token},
                clock=self.clock,
                routed=loaded.routed_tokens,
            )
            self.scheduler.slots, self.scheduler.ready = loaded.kv_table(self.n_slots), loaded.runner.ready
            self.n_slots = len(self.scheduler.slots.slots)
            if self.prefix_store is not None:
                self.prefix_store.restore(self.scheduler.slots, loaded)
            self.loaded, self.state = loaded, "ok"
            self._publish()
        except Exception as e:
            log.exception("model failed to load")
            self.state, self.error = "error", f"{type(e).__name__}: {e}"
            return
        finally:
            self.settled.set()
        self._loop()
        if self.prefix_store is not None:
            self.prefix_store.save(self.scheduler.slots, self.loaded)

    def _loop(self) -> None:
        last_publish = 0.0
        while not self._stopping:
            if not self.scheduler.has_work:
                self._publish()  # the last word before sleeping: every slot idle
                self._busy_since = None  # sleeping on the inbox is not a stall
            self._take_inbox(block=not self.scheduler.has_work)
            self._busy_since = time.monotonic()  # the watchdog's heartbeat: one per pass
            changed = False
            for request in self.scheduler.cancelled():
                self._finish(request, request.cancel_reason)
                changed = True
            for request in self.scheduler.admit():
                with self._lock:
                    self._waiting -= 1
                request.sampler = RequestSampler(request.params, request.prompt_ids, request.constraint)
                self.speculation.admit(request, self.loaded.runner)
                self.metrics.on_admit(request)
                changed = True
            self.loaded.runner.encode(self.scheduler.waiting, not self.scheduler.running)  # a slice of an image's encode between steps
            # publish before the step too, so pages show who is running during a long step
            if changed or self.clock() - last_publish >= PUBLISH_EVERY_S:
                self._publish()
                last_publish = self.clock()
            self._step()
            self.metrics.on_step()
        self._publish()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
            while True:
                if isinstance(item, tuple):  # on_model_thread's
                    _run_task(self, *item)
                elif item is not None:
                    self.scheduler.add(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _step(self) -> None:
        """One pass: schedule (the plan, its prefix copies, the decoding requests' drafts), run,
        postprocess. A mixed plan is one model step (the weights read once for all); should it fail,
        its chunks run again one at a time, then the decoding requests: a failure stays with its request."""
        plan = self.scheduler.plan(mixes=self.loaded.runner.mixes)
        chunks = [c for c in plan.chunks if c.copy is None or self._copy_prefix(c)]
        if plan.mixed and len(chunks) == len(plan.chunks):
            sharing = min(len(self.scheduler.running) + len(self.scheduler.waiting), self.n_slots)
            parts = [Part.prompt(c.request, c.tokens, c.start) for c in chunks] + self._decode_parts(list(plan.decode), sharing)
            if self._run_step(parts, apart=True):
                return
        for chunk in chunks:
            self._run_step([Part.prompt(chunk.request, chunk.tokens, chunk.start)])
        batch = plan.lanes_after_prefill()
        if batch:
            self._run_step(self._decode_parts(batch))

    def _decode_parts(self, batch: list[Request], sharing: int = 0) -> list[Part]:
        positions = [self.scheduler.position(r) for r in batch]
        drafts = self.speculation.drafts(batch, positions, self.loaded, sharing=sharing, room=self.scheduler.room)
        return [Part.decode(request, position, draft) for request, position, draft in zip(batch, positions, drafts, strict=True)]

    def _run_step(self, parts: list[Part], apart: bool = False) -> bool:
        """Run `parts` as one model step and take their outputs; whether it ran. A failed step fails
        its requests, or, `apart`, is only logged: its parts run again apart."""
        try:
            outputs = self.loaded.runner.run(parts)
        except Exception as e:
            if apart:
                log.warning("a mixed step failed; running its parts apart", exc_info=True)
            else:
                self._fail([part.request for part in parts], e)
            return False
        decoding = [(part, rows) for part, rows in zip(parts, outputs, strict=True) if part.decoding]
        for part, output in zip(parts, outputs, strict=True):
            if not part.decoding:
                self._prefilled(part, output)
        if decoding:
            self._verified(decoding)
        return True

    def _copy_prefix(self, chunk: PromptChunk) -> bool:
        """Run the chunk's prefix copy; False if it failed (the request has failed then)."""
        try:
            if chunk.copy.source is not None:  # None: blocks shared, nothing copied
                self.loaded.runner.copy_prefix(chunk.request, chunk.copy.source, chunk.copy.length)
            if chunk.copy.state is not None:  # a snapshot's recurrent states, after the source's
                self.loaded.runner.restore_state(chunk.request, chunk.copy.state)
        except Exception as e:
            self._fail([chunk.request], e)
            return False
        self.metrics.on_cached(chunk.copy.saved)
        return True

    def _prefilled(self, part: Part, output: np.ndarray) -> None:
        """A prompt chunk ran: an embedding pools its outputs, a scored prompt records each next prompt
        token's logprob; the prompt's last chunk samples the first token from its last logits."""
        request, tokens, logits = part.request, part.tokens, part.take(output)
        self.metrics.on_prefill(len(tokens))
        done = self.scheduler.prefilled(request, tokens)
        row = self.scheduler.snapshot_due(request)
        if row is not None:
            try:
                self.loaded.runner.save_state(request, row)
            except Exception:  # only reuse is lost
                log.warning("snapshot of %s's state failed", request.id, exc_info=True)
                self.scheduler.slots.drop(row)
        if done:
            if request.pooling is not None:
                pooling.finish(request, self.loaded.ranker)
                self._finish(request, FinishReason.STOP)
            elif request.params.max_tokens == 0:  # prompt scoring only
                self._finish(request, FinishReason.LENGTH)
            elif not request.output_ids:  # else it resumes after a preemption: its next token is known
                self._sample(request, logits)

    def _sample(self, request: Request, logits: np.ndarray) -> None:
        try:
            token, logprobs = request.sampler.take(logits)
        except Exception as e:  # a grammar that broke: only this request fails
            self._fail([request], e)
            return
        self._emit(request, token, logprobs)

    def _verified(self, decoding: list[tuple[Part, np.ndarray]]) -> None:
        """Take each request's tokens from its lane's rows (a row, or 1 + len(drafts) when it drafted),
        sampled in order as plain decoding would (the same logits, its own generator), keeping a draft
        while the sample equals it: the output is, token for token, what it is without speculation."""
        for part, lane_rows in decoding:
            request, draft = part.request, part.drafts
            accepted, drafter = 0, request.drafter  # kept: a request that ends here lets go of its drafter
            for i, row in enumerate(np.atleast_2d(lane_rows)):
                # row i read the request's last output token (i = 0) or draft[i - 1]: usable only
                # while each draft so far was the token sampled at its position
                if i > 0 and (request.status is not Status.DECODE or request.output_ids[-1] != draft[i - 1]):
                    break
                accepted += i > 0
                self.scheduler.decoded(request)
                if request.status is not Status.DECODE:
                    break
                self._sample(request, row)
            if draft:
                self.loaded.runner.kept(request, 1 + accepted)  # the lanes whose tokens the cache now holds
                request.drafted_tokens += len(draft)
                request.accepted_tokens += accepted
                self.metrics.on_drafts(len(draft), accepted)
                if drafter is not None:
                    drafter.update(len(draft), accepted)

    def _emit(self, request: Request, token: int, logprobs=None) -> None:
        params = request.params
        if token in params.stop_token_ids:
            self._finish(request, FinishReason.STOP)
            return
        now = self.clock()
        self.metrics.on_token(request, now)
        if request.first_token_at is None:
            request.first_token_at = now
        request.last_token_at = now
        request.output_ids.append(token)
        if request.drafter is not None:
            request.drafter.extend((token,))
        if logprobs is not None:
            request.logprobs.append(logprobs)
        request.outputs.put(token)
        # the next step would write position prompt_len + len(output_ids) - 1, which must fit the cache
        if len(request.output_ids) >= params.max_tokens or request.prompt_len + len(request.output_ids) >= self.loaded.context:
            self._finish(request, FinishReason.LENGTH)

    def _finish(self, request: Request, reason: str) -> None:
        was_waiting = request.status is Status.WAITING and not request.preemptions  # counted in _waiting
        self.scheduler.finish(request, reason)
        if was_waiting:
            with self._lock:
                self._waiting -= 1
        self.metrics.on_finish(request)
        self.speculation.finished(request, reason)
        request.sampler = request.constraint = request.drafter = None
        request.outputs.put(Finished(reason))

    def _fail(self, requests: list[Request], error: Exception) -> None:
        log.exception("engine step failed for %s", ", ".join(r.id for r in requests), exc_info=error)
        for request in requests:
            self.scheduler.forget_slot(request)
            request.outputs.put(error)
            self._finish(request, FinishReason.ERROR)

    def _publish(self) -> None:
        scheduler = self.scheduler
        self.metrics.publish(self._waiting, scheduler.running, scheduler.slots.slots, scheduler.kv_pool(), scheduler.state_snapshots())


def _run_task(engine: Engine, task: Callable[[Engine], object], done: Future) -> None:
    try:
        done.set_result(task(engine))
    except Exception as e:  # the caller's to raise, not the model thread's
        done.set_exception(e)
