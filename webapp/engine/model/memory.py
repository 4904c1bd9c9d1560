"""What a model will take in memory, said before its weights are read.

Contract: `auto_context(config, table, slots, kept_types, device, kv_type)` is the context a slot gets
when `LLM_MAX_CONTEXT` is "auto", with the reason in words for the start-up log.
`plan(config, table, slots, positions, kept_types, kv_type, step_writes)` returns a `MemoryPlan` (weights bytes,
the KV cache's type, its bytes per token and when every slot is full, the memory available to this
process); `kv_type` is the cache's rows (kv_types.py: float16, or Q8_0 at 34 bytes per 32 values,
so 8-bit rows give "auto" 1.88x the positions); `check()` raises
`ModelLoadError` in one line when the weights alone cannot fit, and `describe()` is the start-up
log's line. Weights in `kept_types` stay in the file's bytes (the CPU kernels' block formats);
every other matrix becomes float16. The KV cache's pages are committed only as positions fill
(model.py maps zero pages), so a full cache beyond what is available is logged as a warning, not
refused: short conversations never need it. A sliding-window layer on the CPU kernels (step_writes
given: the most positions a step writes to a slot) holds a ring of kv_types.ring_positions, whatever
the context: only the other layers' rows grow with it (`layer_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from webapp.engine.device.capabilities import device_capabilities
from webapp.engine.device.free_memory import device_free_bytes
from webapp.engine.model.config import ModelConfig, used_tensors
from webapp.engine.model.kv_types import KV_TYPES, KvPool, KvRows, cache_positions, ring_positions
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.recurrent_config import spare_state_rows

GIB = 1 << 30
# "auto" context: the slots' caches may take this share of the memory the weights leave free...
KV_SHARE = 0.5
# ...up to this many positions a slot: room for a coding agent's tools and history (Codex CLI sends
# ~10k tokens before the task), not a 128k trained context in every slot
AUTO_CONTEXT_CAP = 32768
AUTO_CONTEXT_FLOOR = 2048  # below this a chat is cut short: take it, and the memory plan warns
FIXED_CONTEXT = 4096  # where the memory the cache would live in is not known (a device that does not say: device/free_memory.py)


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_cache: int
    available: int | None
    slots: int
    positions: int
    kv_type: str
    kv_bytes_per_token: int  # every layer's key and value rows of one position
    pool: KvPool | None = None  # a paged cache's pool (its positions are kv_cache's), else slots

    def check(self) -> None:
        if self.available is not None and self.weights > self.available:
            raise ModelLoadError(
                f"the model needs {self.weights / GIB:.1f} GiB for its weights and {self.available / GIB:.1f} GiB is available: "
                "a smaller file (a lower-bit quantization) or a bigger machine is needed"
            )

    def describe(self) -> str:
        if self.pool is not None:
            cache = (
                f"a pool of {self.pool.blocks} blocks of {self.pool.block_positions} positions ({self.pool.pool_positions} positions "
                f"shared by up to {self.slots} sequences of up to {self.positions})"
            )
        else:
            cache = f"{self.slots} slots x {self.positions} positions"
        line = (
            f"memory: weights {self.weights / GIB:.2f} GiB, KV cache ({self.kv_type}, {self.kv_bytes_per_token / 1024:.1f} KiB a token) "
            f"{cache} = {self.kv_cache / GIB:.2f} GiB when full (committed as positions fill)"
        )
        if self.available is not None:
            line += f", {self.available / GIB:.1f} GiB available"
            if self.weights + self.kv_cache > self.available:
                line += (
                    "; a full cache would not fit: lower "
                    + ("LLM_KV_BUDGET" if self.pool else "LLM_SLOTS or LLM_MAX_CONTEXT")
                    + " if long requests fail"
                )
        return line


def kv_bytes_per_position(config: ModelConfig, kv_type: KvRows = KV_TYPES["f16"], rings: bool = False) -> int:
    """Every layer's key and value rows of one position, or with `rings` the layers' whose rows grow
    with the context (a ring's are a slot's whatever its length)."""
    layers = sum(1 for i in range(config.n_layers) if not (rings and config.window(i)) and not config.recurrent_layer(i))
    return layers * _row_pair_bytes(config, kv_type)


def state_bytes(config: ModelConfig) -> int:
    """A slot's recurrent layers' states (float32), whatever the context (none: 0)."""
    return sum(4 * config.recurrent.state_floats for i in range(config.n_layers) if config.recurrent_layer(i))


def spare_state_bytes(config: ModelConfig, slots: int) -> int:
    """The recurrent states kept beside `slots` slots': snapshots and drafted tokens' (recurrent_config.spare_state_rows)."""
    return spare_state_rows(slots) * state_bytes(config)


def _row_pair_bytes(config: ModelConfig, kv_type: KvRows) -> int:
    """One layer's key and value rows of one position, every kv head."""
    return config.cache_rows * config.n_kv_heads * kv_type.row_bytes(config.head_dim)


def layer_positions(config: ModelConfig, positions: int, step_writes: int | None = None) -> list[int]:
    """Each layer's cache positions a slot (kv_types.cache_positions: `positions`, or a ring; a
    recurrent layer none: its state is state_bytes')."""
    return [0 if config.recurrent_layer(i) else cache_positions(config.window(i), positions, step_writes) for i in range(config.n_layers)]


def ring_bytes(config: ModelConfig, kv_type: KvRows, step_writes: int) -> int:
    """A slot's sliding-window layers' rings, whatever the context (none: 0)."""
    rings = sum(ring_positions(config.window(i), step_writes) for i in range(config.n_layers) if config.window(i))
    return rings * _row_pair_bytes(config, kv_type)


def slot_bytes(config: ModelConfig, positions: int, kv_type: KvRows, step_writes: int | None = None) -> int:
    """A slot's whole cache, every layer's rows (`layer_positions`) and recurrent states."""
    return sum(layer_positions(config, positions, step_writes)) * _row_pair_bytes(config, kv_type) + state_bytes(config)


def weight_bytes(config: ModelConfig, table: dict, kept_types: set[int]) -> int:
    weights = 0
    for name in used_tensors(config, table):
        raw = table[name]
        kept = raw.ggml_type in kept_types or raw.rows == 1  # vectors are read as they are
        weights += raw.nbytes if kept else 2 * raw.rows * raw.cols
    return weights


def plan(
    config: ModelConfig,
    table: dict,
    slots: int,
    positions: int,
    kept_types: set[int],
    kv_type: KvRows = KV_TYPES["f16"],
    step_writes: int | None = None,
) -> MemoryPlan:
    weights, per_token = weight_bytes(config, table, kept_types), kv_bytes_per_position(config, kv_type, step_writes is not None)
    kv_cache = (slots + 1) * slot_bytes(config, positions, kv_type, step_writes) + spare_state_bytes(config, slots)
    return MemoryPlan(weights, kv_cache, available_bytes(), slots, positions, kv_type.name, per_token)


def pool_plan(
    config: ModelConfig, table: dict, kept_types: set[int], kv_type: KvRows, rows: int, context: int | None, budget: tuple[str, int] | None
) -> tuple[MemoryPlan, str]:
    """A paged cache's pool and its memory plan, and why it is that size, in words. `budget` is
    LLM_KV_BUDGET as ("positions" | "bytes", n); None: KV_SHARE of the memory the weights leave free,
    never more than every row at the whole context. The context (None: the trained one) is what one
    sequence may reach, within the pool."""
    per_position = kv_bytes_per_position(config, kv_type)
    context = min(context or config.trained_context, config.trained_context)
    weights, available = weight_bytes(config, table, kept_types), available_bytes()
    if budget is not None:
        kind, amount = budget
        positions = amount if kind == "positions" else amount // per_position
        why = f"LLM_KV_BUDGET={amount}{'' if kind == 'positions' else ' bytes'}"
    elif available is None:
        positions, why = rows * min(context, FIXED_CONTEXT), "this machine's free memory is not known"
    else:
        free = max(0, available - weights)
        positions = min(rows * context, int(free * KV_SHARE) // per_position)
        why = f"at most {KV_SHARE:.0%} of the {free / GIB:.1f} GiB the weights leave free, no more than {rows} sequences of {context}"
    pool = KvPool(blocks=positions // KvPool.block_positions, rows=rows, positions=context)
    if pool.pool_positions <= AUTO_CONTEXT_FLOOR // 8:
        raise ModelLoadError(f"the KV cache's pool holds {pool.pool_positions} positions ({why}): too few to serve a chat")
    pool = KvPool(pool.blocks, rows, min(context, pool.pool_positions - 1))  # one sequence may fill the pool, less its next position
    kv_cache = pool.pool_positions * per_position
    return MemoryPlan(weights, kv_cache, available, rows, pool.positions, kv_type.name, per_position, pool), why


def auto_context(
    config: ModelConfig,
    table: dict,
    slots: int,
    kept_types: set[int],
    device: str,
    kv_type: KvRows = KV_TYPES["f16"],
    step_writes: int | None = None,
) -> tuple[int, str]:
    """Positions a slot for `LLM_MAX_CONTEXT=auto`: what KV_SHARE of the memory left after the
    weights holds for every slot (and the scratch slot), in steps of 256, within the model's trained
    context and AUTO_CONTEXT_CAP; and why, in words."""
    trained = config.trained_context
    cap = min(trained, AUTO_CONTEXT_CAP)
    host = device_capabilities(device).host_ram
    available = available_bytes() if host else device_free_bytes(device)
    if available is None:
        where = "this machine's" if host else f"{device}'s"
        return min(cap, FIXED_CONTEXT), f"{where} free memory is not known"
    free = max(0, available - weight_bytes(config, table, kept_types))
    rings = (slots + 1) * ((0 if step_writes is None else ring_bytes(config, kv_type, step_writes)) + state_bytes(config))
    rings += spare_state_bytes(config, slots)
    per_position = (slots + 1) * kv_bytes_per_position(config, kv_type, step_writes is not None)
    # every layer windowed (a ring each): no cache grows with the context
    fits = max(0, int(free * KV_SHARE) - rings) // per_position // 256 * 256 if per_position else cap
    positions = max(min(cap, fits), min(cap, AUTO_CONTEXT_FLOOR))
    why = f"{slots} slots' {kv_type.name} caches in at most {KV_SHARE:.0%} of the {free / GIB:.1f} GiB the weights leave free hold {fits} positions each"
    if positions == cap:
        why += f"; capped at {cap} ({'the trained context' if cap == trained else 'the most the server picks by itself'})"
    elif positions > fits:
        why += f"; {positions} at the least"
    return positions, why


def available_bytes() -> int | None:
    """MemAvailable, or what the process's cgroup still allows if that is less; None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, available)
