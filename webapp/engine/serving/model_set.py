"""Several models in one server: every GGUF in `LLM_MODELS_DIR`, each served by its own `Engine` (its
own model thread, slots and queue), loaded on first use and unloaded least recently used first.

Contract:
- `files()` is the folder's listing, read again at every call (a file copied in is offered at
  once): each `*.gguf` but projectors (`NAME.mmproj.gguf`, `mmproj-NAME.gguf`: loaded with NAME)
  as a `ModelFile` named by its file name without `.gguf`, the way the single model is named; `LLM_MODEL`'s file (`first`) comes first even when it lies elsewhere, and is the
  model of a request that names none (else the first by name). A name is only ever looked up in
  that listing, so `../x`, an absolute path or a file outside the folder is `ModelNotFound` and
  nothing is opened.
- `lease(name)` returns a `Lease` on the named model's engine, ready to serve; the caller releases
  it when the response is closed. A model not loaded is loaded then, and the caller waits
  (`EngineNotReady` if it fails; the file is not tried again until it changes). A model holding a
  lease is never unloaded. Before a load, idle models are unloaded, least recently used first,
  until the loaded models' `footprint` plus the new one's fits `budget` (`LLM_MEMORY_BUDGET`);
  when only busy models could make room the caller waits up to `wait_s` for them to finish, then
  gets `ModelsBusy` (the API's 503 with Retry-After). A model alone over the budget still loads
  when nothing else is loaded (logged). Loads run one at a time: tinygrad keeps one kernel-cache
  connection per process, usable by one thread (`use_tinygrad_from_this_thread`, called by the loader).
- Idle sleep (`idle_s`, LLM_IDLE_UNLOAD_SECONDS): a loaded model no request has held for that long
  is unloaded, its memory given back, and the next request for it loads it again and waits. A lease
  may set its model's own idle time for after it (`lease(name, keep_alive)`: Ollama's `keep_alive`;
  0 unloads it once the request ends, a negative one keeps it loaded). `folder` may be None: the set
  is then LLM_MODEL's model alone, which is how a single model sleeps, and answers any name.
- A model's `footprint` is its file's size (the CPU kernels keep the weights in the file's bytes;
  the float16 path takes more), plus its KV cache when every slot is full once it has loaded (the
  budget is checked again then, idle models unloaded to meet it), plus its LoRA adapters as loaded
  now, at run time too (counted at the next load's check).
- The engine's doors the app uses beside requests: `start()` (loads `first`), `health()`,
  `stats(model)` (one model's stats for the dashboard, with `models`, the listing),
  `model_stats()` (every loaded model's, for /metrics), `abort(request)`, `stop(timeout)`.

No Flask, no tinygrad: engines come from `make_engine(path)` (`webapp.engine.serving.loader`).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from webapp.engine.serving.errors import EngineNotReady, ModelLoadFailed
from webapp.engine.serving.model_files import SUFFIX, ModelFile, is_projector, model_file

if TYPE_CHECKING:
    from webapp.engine.serving.engine import Engine

log = logging.getLogger(__name__)

STATUS = {"loading": "loading", "ok": "loaded", "error": "failed"}  # an engine's state, as the listing says it
WAIT_S = 30.0  # how long a load waits for busy models to finish before its request gets a 503
STOP_S = 10.0  # how long an unloaded model's thread may take to end its last pass


class ModelNotFound(LookupError):
    """No model of that name in the listing."""


class ModelsBusy(Exception):
    """Making room for a model needs a busy model unloaded, and none finished in time."""


@dataclass(eq=False)
class Member:
    """A model with an engine: loading or loaded."""

    file: ModelFile
    engine: Engine
    base: int  # bytes counted against the budget: its file's (an estimate while it loads), then its KV cache's too
    last_used: float
    leases: int = 0
    settled: bool = False  # its load's outcome is accounted for
    keep_alive: float | None = None  # its last request's idle time before it sleeps (None: the set's)

    @property
    def footprint(self) -> int:
        """`base` and, once loaded, its LoRA adapters as they are now (loaded at run time too)."""
        adapters = self.engine.loaded.adapters if self.settled and self.engine.loaded is not None else None
        return self.base + (adapters.nbytes if adapters is not None else 0)


class Lease:
    """One request's hold on a model's engine; `release()` once its response is closed (idempotent)."""

    def __init__(self, models: ModelSet, member: Member):
        self._models, self._member = models, member
        self.engine = member.engine
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._models._release(self._member)


class ModelSet:
    def __init__(
        self,
        folder: str,
        make_engine: Callable[[str], Engine],
        budget: int | None = None,
        first: str | None = None,
        wait_s: float = WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        idle_s: float | None = None,
    ):
        self.folder, self.budget, self.wait_s, self.idle_s = folder, budget, wait_s, idle_s
        self._make_engine, self._clock = make_engine, clock
        self.first = model_file(first) if first else None
        self._members: dict[str, Member] = {}
        self._loading: Member | None = None  # the one model loading now
        self._failed: dict[str, tuple[ModelFile, str]] = {}  # name -> (the file as it failed, why)
        self._measured: dict[ModelFile, int] = {}  # footprints of files loaded before
        self._cond = threading.Condition()
        self._stopping = False
        self._sleeper: threading.Thread | None = None

    # --- the listing ------------------------------------------------------------------------------

    def files(self) -> list[ModelFile]:
        found = {self.first.name: self.first} if self.first else {}
        if self.folder is None:
            return list(found.values())
        try:
            entries = sorted(os.scandir(self.folder), key=lambda e: e.name)
        except OSError:
            log.warning("LLM_MODELS_DIR=%r cannot be read", self.folder, exc_info=True)
            entries = []
        for entry in entries:
            if entry.name.endswith(SUFFIX) and not entry.name.startswith(".") and not is_projector(entry.name) and entry.is_file():
                try:
                    found.setdefault(entry.name.removesuffix(SUFFIX), model_file(entry.path))
                except OSError:  # removed since the folder was read
                    continue
        return list(found.values())

    def find(self, name: str | None) -> ModelFile:
        if self.folder is None and self.first is not None:  # a set of one answers any name, as one model does
            return self.first
        files = self.files()
        if name is None and files:
            return files[0]
        match = next((f for f in files if f.name == name), None)
        if match is None:
            raise ModelNotFound(f"The model `{name}` does not exist." if name is not None else "No model is available.")
        return match

    def listing(self) -> list[dict]:
        """Each model of the folder with its size, created time and status (loaded, loading, unloaded, failed)."""
        with self._cond:
            self._settle_finished()
            members = dict(self._members)
            failed = dict(self._failed)
        out = []
        for file in self.files():
            member = members.get(file.name)
            state = "unloaded" if member is None else STATUS[member.engine.state]
            if member is None and failed.get(file.name, (None,))[0] == file:
                state = "failed"
            entry = {"id": file.name, "created": int(file.mtime), "size": file.size, "loaded": state == "loaded", "status": state}
            if member is not None:
                entry.update(memory_bytes=member.footprint, running=member.leases)
            out.append(entry)
        return out

    # --- leases -----------------------------------------------------------------------------------

    def lease(self, name: str | None, keep_alive: float | None = None) -> Lease:
        file = self.find(name)
        deadline = self._clock() + self.wait_s
        claim = None
        while claim is None:
            claim = self._claim(file, deadline)
        member, victims, created = claim
        self._unload(victims)
        if created:
            member.engine.start()
        member.engine.settled.wait()
        with self._cond:
            self._settle(member)
        if member.engine.state != "ok":
            self._release(member)
            raise ModelLoadFailed(f"the model {file.name} failed to load: {member.engine.error}")
        if keep_alive is not None:
            member.keep_alive = keep_alive
        return Lease(self, member)

    def _claim(self, file: ModelFile, deadline: float) -> tuple[Member, list[Member], bool] | None:
        """A lease on the file's model: (its member, the models to unload first, whether its load
        is ours to start); None after waiting, for another model's load or a busy model's release."""
        with self._cond:
            if self._stopping:
                raise EngineNotReady("the server is shutting down")
            self._settle_finished()
            member, victims, created = self._members.get(file.name), [], False
            if member is None and self._loading is not None:
                other_load = self._loading.engine.settled
            elif member is None:
                self._refuse_failed(file)
                victims = self._room_for(self._measured.get(file, file.size), file.name)
                if victims is None:
                    left = deadline - self._clock()
                    if left <= 0:
                        raise ModelsBusy(f"Every loaded model is busy; `{file.name}` cannot be loaded yet.")
                    self._cond.wait(left)  # woken when a lease is released
                    return None
                member, created = self._add(file, victims), True
            if member is not None:
                member.leases += 1
                member.last_used = self._clock()
                return member, victims, created
        other_load.wait()  # one load at a time: wait for it, not under the lock
        return None

    def _release(self, member: Member) -> None:
        with self._cond:
            member.leases -= 1
            member.last_used = self._clock()
            self._cond.notify_all()
        if member.keep_alive == 0:  # Ollama's keep_alive 0: asleep as soon as nothing holds it
            self.sleep_idle()

    def sleep_idle(self) -> list[str]:
        """Unload every loaded model left idle past its idle time; their names."""
        with self._cond:
            now = self._clock()
            idle = [
                m
                for m in self._members.values()
                if m.leases == 0 and m.settled and m is not self._loading and _sleeps(m.keep_alive, self.idle_s, now - m.last_used)
            ]
            for member in idle:
                del self._members[member.file.name]
        names = [m.file.name for m in idle]
        self._unload(idle, "idle")
        return names

    def _sleep_when_idle(self) -> None:
        """The sleeper thread: looks for idle models a few times an idle time, until stop()."""
        period = max(0.05, min(self.idle_s or 1.0, 5.0) / 4)
        while True:
            with self._cond:
                if self._stopping:
                    return
                self._cond.wait(period)
            self.sleep_idle()

    def _refuse_failed(self, file: ModelFile) -> None:
        failed = self._failed.get(file.name)
        if failed is not None and failed[0] == file:
            raise ModelLoadFailed(f"the model {file.name} failed to load: {failed[1]}")

    def _add(self, file: ModelFile, victims: list[Member]) -> Member:
        """Take the victims out of the set and put the new model in its place, loading (lock held)."""
        for victim in victims:
            del self._members[victim.file.name]
        member = Member(file, self._make_engine(file.path), self._measured.get(file, file.size), self._clock())
        self._members[file.name] = self._loading = member
        return member

    def _room_for(self, need: int, name: str, keep: Member | None = None) -> list[Member] | None:
        """The idle models to unload, least recently used first, so that `need` more bytes fit the
        budget; None when busy models would have to go too (lock held)."""
        others = [m for m in self._members.values() if m is not keep]
        used = sum(m.footprint for m in others)
        if self.budget is None or used + need <= self.budget:
            return []
        victims = []
        for member in sorted((m for m in others if m.leases == 0 and m is not self._loading), key=lambda m: m.last_used):
            victims.append(member)
            used -= member.footprint
            if used + need <= self.budget:
                return victims
        if len(victims) == len(others):  # nothing else would be left: this model alone is over the budget
            log.warning("model %s alone (%d bytes) is over LLM_MEMORY_BUDGET=%d; it is served anyway", name, need, self.budget)
            return victims
        return None

    def _settle_finished(self) -> None:
        if self._loading is not None and self._loading.engine.settled.is_set():
            self._settle(self._loading)

    def _settle(self, member: Member) -> None:
        """Account for a load that has ended: its real footprint, or its failure (lock held)."""
        if member.settled:
            return
        member.settled = True
        if self._loading is member:
            self._loading = None
        engine = member.engine
        if engine.state != "ok":
            self._members.pop(member.file.name, None)
            self._failed[member.file.name] = (member.file, engine.error or engine.state)
        else:
            kv = engine.loaded.kv_bytes(engine.n_slots)
            member.base = member.file.size + kv
            self._measured[member.file] = member.footprint  # LLM_LORA_DIR's adapters too
            victims = self._room_for(member.footprint, member.file.name, keep=member)
            if victims is None:
                log.warning(
                    "the loaded models pass LLM_MEMORY_BUDGET=%d while the busy ones cannot go; the next load makes room", self.budget
                )
                victims = []
            for victim in victims:
                del self._members[victim.file.name]
            if victims:  # stopping joins a model thread: not under the lock, on a thread of its own
                threading.Thread(target=self._unload, args=(victims,), name="unload", daemon=True).start()
            name, size = member.file.name, member.file.size
            log.info("model %s loaded: %d bytes counted (file %d, KV cache %d, adapters the rest)", name, member.footprint, size, kv)
        self._cond.notify_all()

    def _unload(self, victims: list[Member], why: str = "least recently used") -> None:
        for victim in victims:
            victim.engine.stop(STOP_S)
            log.info("model %s unloaded (%s; %d bytes freed)", victim.file.name, why, victim.footprint)
        if victims:
            victims.clear()
            gc.collect()  # the model's buffers sit in reference cycles: free them now, not at some later collection

    # --- the engine's doors -----------------------------------------------------------------------

    def start(self) -> ModelSet:
        """Begin loading `first` (LLM_MODEL), if any; requests for it wait until it is ready."""
        if self.first is not None:
            with self._cond:
                member = self._add(self.first, [])
            member.engine.start()
        if self.idle_s is not None:
            self._sleeper = threading.Thread(target=self._sleep_when_idle, name="model-sleeper", daemon=True)
            self._sleeper.start()
        return self

    def _ready(self) -> list[Member]:
        with self._cond:
            return [m for m in self._members.values() if m.engine.state == "ok"]

    def health(self) -> dict:
        """200's "ok" while models load and unload; a loaded model's own watchdog state otherwise."""
        for member in self._ready():
            state = member.engine.health()
            if state.get("status") != "ok":
                return {**state, "model": member.file.name}
        return {"status": "ok", "models": {m["id"]: m["status"] for m in self.listing()}}

    def stats(self, model: str | None = None) -> dict:
        """The dashboard's numbers: `model`'s (else the most recently used loaded model's), and the listing."""
        ready = sorted(self._ready(), key=lambda m: m.last_used, reverse=True)
        shown = next((m for m in ready if m.file.name == model), ready[0] if ready else None)
        stats = shown.engine.stats() if shown is not None else {"state": "ok", "model": None}
        return {**stats, "models": self.listing()}

    def model_stats(self) -> dict[str, dict]:
        return {m.file.name: m.engine.stats() for m in self._ready()}

    def abort(self, request) -> None:
        with self._cond:
            engines = [m.engine for m in self._members.values()]
        for engine in engines:  # the one holding the request retires it; the others ignore it
            engine.abort(request)

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            members = list(self._members.values())
            self._cond.notify_all()
        for member in members:
            member.engine.stop(timeout)


def _sleeps(keep_alive: float | None, idle_s: float | None, idle_for: float) -> bool:
    """Whether a model idle for `idle_for` seconds sleeps: its last request's keep_alive (negative:
    never), else the set's idle time (None: never)."""
    limit = keep_alive if keep_alive is not None else idle_s
    return limit is not None and limit >= 0 and idle_for >= limit
