"""The LoRA adapters a loaded model serves (LLM_LORA_DIR), and a request's choice of one.

Contract: `Adapters(fit, table, read)` holds the adapters fitted to one model (`fit(AdapterFile)`
gives model/lora.py's layout, `table` is the steps' `lora_table`, kernels/lora_table.py's or
model/device_lora.py's, `read(path, name)` model/lora.read_adapter); `add(file)` loads one under its name, `from_folder(folder)` every `*.gguf`
of a folder, `names` and `listing()` say what is loaded, `choose(name, scale)` gives a request's
`LoraUse` or raises `UnknownAdapter`; `listing_of(engine)` lists an engine's, empty while it loads.
Whatever changes the table runs on the model thread, between steps: at load, and at run time
through `load(engine, name, path)` and `unload(engine, name)` (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), which handler threads call.

Unloading first retires the adapter (no request chooses it any more), then frees it on the model
thread once no request in the engine runs with it and none chose it for QUIET_S (a handler puts
its request in the engine's inbox right after choosing): a lane never names a freed adapter.

A `LoraUse` names its adapter's load (`lineage`): the KV cache files a sequence's blocks under it,
so a prefix computed with one adapter is never served to a request with another, or with none.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_SCALE = 100.0  # a scale past this is no adapter's intent: refused as a typo
QUIET_S = 1.0  # an adapter chosen this recently may have a request on its way to the engine
UNLOAD_WAIT_S = 30.0  # how long unloading waits for the adapter's running requests to end


class UnknownAdapter(LookupError):
    pass


class AdapterBusy(RuntimeError):
    pass


@dataclass(frozen=True)
class LoraUse:
    """A request's adapter: its name, its index in the steps' table, the scale on its products, and
    the load it names (the KV cache's lineage)."""

    name: str
    index: int
    scale: float
    lineage: str

    @property
    def lane(self) -> tuple[int, float]:
        return self.index, self.scale


@dataclass(frozen=True)
class Loaded:
    name: str
    path: str
    index: int
    rank: int
    alpha: float
    nbytes: int
    lineage: str


class Adapters:
    def __init__(self, fit, table, read):
        self._fit, self._table, self.read = fit, table, read
        self._loaded: dict[str, Loaded] = {}
        self._loads = itertools.count(1)
        self._lock = threading.Lock()  # choosing (handler threads) against retiring
        self._retired: set[str] = set()
        self._chosen_at: dict[str, float] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._loaded)

    @property
    def nbytes(self) -> int:
        """What the adapters take: their fitted matrices, and on tinygrad's path the device's stacks
        (padded to their rank and count) beside them."""
        held = sum(a.nbytes for a in self._loaded.values())
        return held + getattr(self._table, "device_bytes", 0)

    def add(self, adapter) -> Loaded:
        """Fit `adapter` (model/lora.AdapterFile) to the model and load it; ValueError where it does not fit."""
        if adapter.name in self._loaded:
            raise ValueError(f"an adapter named {adapter.name!r} is loaded already")
        fitted = self._fit(adapter)
        index = self._table.add(fitted)
        nbytes = sum(product.nbytes for layer in fitted for product in layer if product)
        lineage = f"lora:{adapter.name}:{next(self._loads)}"
        loaded = Loaded(adapter.name, adapter.path, index, adapter.rank, adapter.alpha, nbytes, lineage)
        with self._lock:
            self._loaded[adapter.name] = loaded
        log.info(
            "LoRA adapter %s: rank %d, alpha %g, %d matrices, %.1f MiB",
            adapter.name,
            adapter.rank,
            adapter.alpha,
            len(adapter.pairs),
            nbytes / 2**20,
        )
        return loaded

    def from_folder(self, folder: str) -> None:
        """Every adapter GGUF in `folder`, in name order."""
        for path in sorted(glob.glob(os.path.join(folder, "*.gguf"))):
            self.add(self.read(path))

    def choose(self, name: str, scale: float = 1.0) -> LoraUse:
        with self._lock:
            loaded = None if name in self._retired else self._loaded.get(name)
            if loaded is None:
                known = ", ".join(n for n in self.names if n not in self._retired) or "none are loaded"
                raise UnknownAdapter(f"no LoRA adapter named {name!r} ({known})")
            self._chosen_at[name] = time.monotonic()
        return LoraUse(name, loaded.index, float(scale), loaded.lineage)

    def retired(self, name: str) -> bool:
        return name in self._retired

    def retire(self, name: str) -> None:
        with self._lock:
            if name not in self._loaded or name in self._retired:
                raise UnknownAdapter(f"no LoRA adapter named {name!r} is loaded")
            self._retired.add(name)

    def free_if_unused(self, name: str, running: set[str]) -> bool:
        """On the model thread: free a retired adapter that no request runs with (`running`: the
        lineages of the engine's requests) and none chose for QUIET_S; whether it was freed."""
        loaded = self._loaded[name]
        if loaded.lineage in running or time.monotonic() - self._chosen_at.get(name, 0.0) < QUIET_S:
            return False
        self._table.remove(loaded.index)
        with self._lock:
            del self._loaded[name]
            self._retired.discard(name)
        log.info("LoRA adapter %s unloaded", name)
        return True

    def listing(self) -> list[dict]:
        return [
            {"name": a.name, "path": a.path, "rank": a.rank, "alpha": a.alpha, "bytes": a.nbytes, "retired": a.name in self._retired}
            for a in sorted(self._loaded.values(), key=lambda a: a.name)
        ]


def listing_of(engine) -> list[dict]:
    """`engine`'s adapters' listing: empty while it loads, or where its model takes none."""
    loaded = engine.loaded
    return loaded.adapters.listing() if loaded is not None and loaded.adapters is not None else []


def load(engine, name: str, path: str) -> Loaded:
    """Load the adapter file at `path` as `name` into `engine`'s model, on its model thread;
    ValueError where it cannot be read or does not fit, UnknownAdapter where the model takes none."""
    adapters = engine.adapters
    if adapters is None:
        raise UnknownAdapter(
            f"{engine.model_name} takes no LoRA adapters (they run in models without recurrent layers, on the CPU kernels' one-call steps or on tinygrad's)"
        )
    return engine.on_model_thread(lambda e: adapters.add(adapters.read(path, name)))


def unload(engine, name: str, wait_s: float = UNLOAD_WAIT_S) -> None:
    """Retire `name` and free it once its requests have ended; AdapterBusy after `wait_s` (it stays
    retired: no new request takes it, and the next unload frees it)."""
    adapters = engine.adapters
    if adapters is None:
        raise UnknownAdapter(f"{engine.model_name} takes no LoRA adapters")
    if not adapters.retired(name):
        adapters.retire(name)
    deadline = time.monotonic() + wait_s
    while not engine.on_model_thread(lambda e: adapters.free_if_unused(name, _running_lineages(e))):
        if time.monotonic() > deadline:
            raise AdapterBusy(f"the LoRA adapter {name!r} still runs requests; no new one takes it, and it is freed when they end")
        time.sleep(0.05)


def _running_lineages(engine) -> set[str]:
    scheduler = engine.scheduler
    return {r.lineage for r in (*scheduler.running, *scheduler.waiting) if r.lineage is not None}
