"""A fake model that really keeps its keys in a paged cache: every step writes each fed token into the
block its row's table names, and each next token is a function of the whole sequence read back
through the table. A block handed to two sequences, a stale or missing block, or a recompute that
differs from the first pass changes the tokens, so the engine's outputs tell whether the
bookkeeping held (tests/unit/test_paged_engine.py)."""

from __future__ import annotations

import numpy as np

from webapp.engine.model.kv_types import KvPool
from webapp.engine.serving.loaded_model import LoadedModel
from webapp.engine.serving.request import Request


class PagedFakeRunner:
    mixes = True
    speculates = True
    draft = None
    drafted_limit = None
    verify_seconds = None

    def __init__(self, pool: KvPool, vocab: int = 50):
        self.pool, self.vocab = pool, vocab
        self.table = np.zeros((pool.rows + 1, pool.table_width), np.int32)
        self.trash = pool.blocks
        self.rows: dict[tuple[int, int], int] = {}  # (block, row in it) -> the token written there
        self.steps = 0
        self.on_step = None  # called before each model call, on the model thread (a test's probe)

    def loaded(self, context: int | None = None) -> LoadedModel:
        from support.fakes import FakeChatTemplate, FakeTokenizer

        context = context or self.pool.positions
        return LoadedModel(
            self, FakeTokenizer(), FakeChatTemplate(), "paged-fake", context, "FAKE", kv_pool=self.pool, block_table=self.table
        )

    # --- the cache ---------------------------------------------------------------------------------

    def _where(self, row: int, position: int) -> tuple[int, int]:
        block = int(self.table[row, position // self.pool.block_positions])
        assert block != self.trash, f"row {row} writes or reads position {position} outside its blocks"
        return block, position % self.pool.block_positions

    def _feed(self, row: int, tokens: list[int], start: int) -> list[np.ndarray]:
        """Write `tokens` from `start`, then each one's logits: one-hot at a hash of the sequence so far."""
        if self.on_step is not None:
            self.on_step()
        for i, token in enumerate(tokens):
            self.rows[self._where(row, start + i)] = token
        return [self._logits(row, start + i) for i in range(len(tokens))]

    def _logits(self, row: int, position: int) -> np.ndarray:
        sequence = [self.rows[self._where(row, p)] for p in range(position + 1)]
        h = 7
        for token in sequence:
            h = (h * 31 + token + 1) % 1_000_003
        logits = np.zeros(self.vocab, np.float32)
        logits[h % self.vocab] = 1.0
        return logits

    # --- the Runner contract ------------------------------------------------------------------------

    def warm_up(self, progress) -> float:
        return 0.0

    def run(self, parts) -> list[np.ndarray]:
        from support.fakes import run_by_kind

        return run_by_kind(self, parts)

    def prefill(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        self.steps += 1
        return self._feed(request.slot, tokens, start)[-1]

    def prompt_logits(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        self.steps += 1
        return np.stack(self._feed(request.slot, tokens, start))

    def decode(self, batch: list[Request], positions: list[int]) -> np.ndarray:
        self.steps += 1
        return np.stack([self._feed(r.slot, [r.output_ids[-1]], p)[0] for r, p in zip(batch, positions, strict=True)])

    def kept(self, request: Request, lanes: int) -> None:
        pass

    def ready(self, request: Request) -> bool:
        return True  # no images

    def encode(self, waiting, alone: bool = False) -> None:
        pass

    def decode_drafted(self, batch: list[Request], drafts: list[list[int]], positions: list[int]) -> list[np.ndarray]:
        self.steps += 1
        return [np.stack(self._feed(r.slot, [r.output_ids[-1], *d], p)) for r, d, p in zip(batch, drafts, positions, strict=True)]

    def prefill_and_decode(self, chunks, batch: list[Request], positions: list[int]):
        firsts = [self.prefill(r, tokens, start) for r, tokens, start in chunks]
        return firsts, self.decode(batch, positions) if batch else np.zeros((0, self.vocab), np.float32)

    def prefill_and_verify(self, chunks, batch: list[Request], drafts: list[list[int]], positions: list[int]):
        firsts = [self.prefill(r, tokens, start) for r, tokens, start in chunks]
        return firsts, self.decode_drafted(batch, drafts, positions)

    def copy_prefix(self, request: Request, source_slot: int, length: int) -> None:
        raise AssertionError("a paged cache shares blocks: nothing is ever copied")
