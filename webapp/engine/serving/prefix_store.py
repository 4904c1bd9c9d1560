"""The paged KV cache's filed blocks kept across restarts (`LLM_PREFIX_CACHE_DIR`, at most
`LLM_PREFIX_CACHE_BYTES` on disk), so a long system prompt or document is not prefilled again after
a restart.

Contract: `PrefixStore(folder, cap, model_path)`. `save(table, runner)` runs on the model thread as
it stops: the pool's filed blocks, the most recently used first, each with the blocks before it in
its sequence, as many as `cap` holds, written with every layer's rows to one file named for the model
(its name and the SHA-256 of its bytes), replacing the last one. `restore(table, runner)` runs on
the model thread after warm-up: the file's blocks, as many as half the pool, are allocated,
written, filed and left cached (held by no one), so the first request with that prefix holds them as
any cached block. Both return how many blocks they moved.

A save writes a temporary file, syncs it to the disk and renames it over the last one, so a process
killed during a save, a power cut or a full disk leaves the last good file (and, but for a full
disk, whose bytes are removed at once, a `.partial` file the next saves remove once an hour old).
The file is read as untrusted: a file of another model (another digest in its name is never even
opened), another KV type, block size or layer shapes, or one that is damaged, is refused with one
line in the log and nothing restored. The digest of the whole model file is what keys it: a file
changed in place, even by a byte, gets another name.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import tempfile
import time
import zipfile

import numpy as np

from webapp.engine.serving.paged_slots import PagedSlots

log = logging.getLogger(__name__)

VERSION = 1
STALE_PARTIAL_S = 3600


class PrefixStore:
    def __init__(self, folder: str, cap: int, model_path: str):
        self.folder, self.cap, self.model_path = folder, cap, model_path
        self._digest: str | None = None

    @property
    def path(self) -> str:
        if self._digest is None:
            with open(self.model_path, "rb") as f:
                self._digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        name = os.path.basename(self.model_path).removesuffix(".gguf")
        return os.path.join(self.folder, f"{name}-{self._digest}.kvcache.npz")

    def save(self, table, loaded) -> int:
        return self._logged(self._save, table, loaded, "saved to")

    def restore(self, table, loaded) -> int:
        return self._logged(self._restore, table, loaded, "restored from")

    def _logged(self, move, table, loaded, what: str) -> int:
        """`move` on a paged pool (slots keep no filed blocks), its count logged; a failure costs only the reuse."""
        if not isinstance(table, PagedSlots):
            return 0
        started = time.monotonic()
        try:
            blocks = move(table, loaded)
        except Exception:
            log.exception("prefix cache: %s %s failed", what, self.folder)
            return 0
        if blocks:
            log.info("prefix cache: %d blocks %s %s in %.1f s", blocks, what, self.path, time.monotonic() - started)
        return blocks

    def _save(self, table: PagedSlots, loaded) -> int:
        pool, runner = table.pool, loaded.runner
        chosen = self._chosen(pool, runner.block_bytes())
        if not chosen:
            return 0
        by_seal = {pool.blocks[b].seal: i for i, b in enumerate(chosen)}
        parents = np.array([by_seal.get(pool.blocks[b].key[0], -1) for b in chosen], np.int32)
        tokens = np.array([pool.blocks[b].key[1] for b in chosen], np.int32)
        rows = runner.block_rows(chosen)
        header = np.array([VERSION, pool.block_positions, len(rows)], np.int64)
        os.makedirs(self.folder, exist_ok=True)
        for stale in glob.glob(os.path.join(self.folder, "*.partial")):
            # a save cut short by an exit; a younger one may be another replica's, being written
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(stale) > STALE_PARTIAL_S:
                    os.unlink(stale)
        fd, partial = tempfile.mkstemp(dir=self.folder, suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    header=header,
                    kv_type=np.array(loaded.kv_type),
                    parents=parents,
                    tokens=tokens,
                    **{f"layer{i}": r for i, r in enumerate(rows)},
                )
                f.flush()
                os.fsync(f.fileno())  # on the disk before it takes the name: a power cut leaves the old file or this one
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk: the last good file stays, and this one's bytes go
                os.unlink(partial)
            raise
        os.replace(partial, self.path)  # a reader never sees half a file
        return len(chosen)

    def _chosen(self, pool, block_bytes: int) -> list[int]:
        """Filed blocks within the cap, most recently used first with the blocks before them (as many
        of those as fit, from the sequence's start); in the order they were filed, so a block's
        parent always comes before it."""
        by_seal = {b.seal: b.id for b in pool.blocks if b.seal}
        recent = [b.id for b in pool.blocks if b.seal and b.refs] + list(reversed(pool.cached_order()))
        chosen: set[int] = set()
        room = self.cap // block_bytes
        for block_id in recent:
            chain = _rooted_chain(pool, block_id, by_seal, chosen)
            chosen.update(reversed(chain[-(room - len(chosen)) :]) if room > len(chosen) else ())
        return sorted(chosen, key=lambda b: pool.blocks[b].seal)

    def _restore(self, table: PagedSlots, loaded) -> int:
        path = self.path
        for cut_short in glob.glob(os.path.join(self.folder, "*.partial")):
            log.warning("prefix cache: %s is a save cut short (or another replica's, being written); not read", cut_short)
        if not os.path.exists(path):
            return 0
        try:
            with np.load(path, allow_pickle=False) as saved:
                header, kv_type = saved["header"], str(saved["kv_type"])
                parents, tokens = saved["parents"], saved["tokens"]
                rows = [saved[f"layer{i}"] for i in range(int(header[2]))]
        except (OSError, ValueError, KeyError, IndexError, zipfile.BadZipFile) as e:
            log.warning("prefix cache %s: unreadable (%s); not restored", path, e)
            return 0
        runner = loaded.runner
        why = _mismatch(header, kv_type, parents, tokens, rows, table, loaded)
        if why:
            log.warning("prefix cache %s: %s; not restored", path, why)
            return 0
        pool, count = table.pool, min(len(parents), len(table.pool.blocks) // 2)
        ids: list[int] = []
        for i in range(count):
            if parents[i] >= i:
                break  # a parent after its child: not a file this server wrote
            ids.append(pool.allocate())
        runner.write_block_rows(ids, [r[: len(ids)] for r in rows])
        for i, block_id in enumerate(ids):
            pool.seal(block_id, None if parents[i] < 0 else ids[parents[i]], tuple(int(t) for t in tokens[i]))
            pool.drop(block_id)  # filed, held by no one: cached
        return len(ids)


def _rooted_chain(pool, block_id: int, by_seal: dict[int, int], chosen: set[int]) -> list[int]:
    """`block_id` and the blocks before it up to the sequence's start or a chosen block, nearest
    first; none when a block on the way was evicted (its children are never matched again, and saved
    as a sequence's start they would be served as one)."""
    chain: list[int] = []
    while block_id not in chosen:
        chain.append(block_id)
        parent = pool.blocks[block_id].key[0]
        if parent == 0:
            break
        block_id = by_seal.get(parent)
        if block_id is None:
            return []
    return chain


def _mismatch(header, kv_type, parents, tokens, rows, table, loaded) -> str | None:
    """Why a saved file cannot be this model's blocks, or None."""
    runner = loaded.runner
    if header.shape != (3,) or int(header[0]) != VERSION:
        return f"format {header[:1]} (this server writes {VERSION})"
    if int(header[1]) != table.block_positions or kv_type != loaded.kv_type:
        return f"blocks of {int(header[1])} positions of {kv_type} rows, not {table.block_positions} of {loaded.kv_type}"
    shapes = runner.block_row_shapes()
    n = len(parents)
    if parents.dtype != np.int32 or parents.ndim != 1 or tokens.shape != (n, table.block_positions) or tokens.dtype != np.int32:
        return "its block list is malformed"
    if len(rows) != len(shapes) or any(r.shape != (n, *shape) or r.dtype != dtype for r, (shape, dtype) in zip(rows, shapes)):
        return "its layers' rows are not this model's"
    if n and (parents.min() < -1 or tokens.min() < 0 or tokens.max() >= loaded.tokenizer.vocab_size):
        return "its block list is malformed"
    return None
