"""A step's work as ragged lanes: what every way of running a step executes (`Steps.run`).

A `Lane` is one sequence's tokens in a step, fed into `slot` from position `start`, and what it
wants back (`Want`): LAST, the logits (vocab,) of its last token (a prompt chunk, or a decoding
sequence's one token); ALL, every token's logits (len(tokens), vocab) (a scored prompt, or a
verification); HIDDEN, every token's final norm output (len(tokens), dim) (embeddings); TOKEN, the
greedy pick of its last token's logits, an int32 array (1,) holding their argmax (a request that
samples nothing but the most likely token: a device's step then reads back an id, not a row; only
steps that `pick` are given it, base.py). A `decoding`
lane feeds a sequence's last output token, then any drafted tokens after it (`drafted`: a
verification, each drafted token in a recurrent state row of its own where the model has such
layers); any other lane is a prompt chunk, whose `inputs` are (offset, rows) pairs: rows (n, dim)
float32 fed at tokens offset .. offset + n - 1 in place of their embeddings (an image's); with
`inputs_both_ways` each such run of positions attends all of itself, later ones too (Gemma 3's
image, which the scheduler never cuts across chunks). `rope_positions` (3, len(tokens)) are the
positions a model with M-RoPE sections turns each token by (an image's rows by its time, row and
column, the text after it by positions that count the image as its longer side; only steps that
`turns_by_sections` are given them), None: each token's own position. `lora`: a
LoRA adapter's index in the steps' `lora_table` and the scale on its products, or None. The lanes of
one step hold distinct slots, and a lane's numbers never depend on the others beside it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class Want(enum.Enum):
    LAST = "last"
    ALL = "all"
    HIDDEN = "hidden"
    TOKEN = "token"


@dataclass(frozen=True)
class Lane:
    slot: int
    start: int
    tokens: Sequence[int]
    want: Want = Want.LAST
    decoding: bool = False
    inputs: tuple = ()
    lora: tuple[int, float] | None = None
    inputs_both_ways: bool = False
    rope_positions: np.ndarray | None = None  # (3, len(tokens)): M-RoPE's time, row and column a token

    @property
    def drafted(self) -> bool:
        """A verification: a decoding sequence's token, then drafted ones."""
        return self.decoding and len(self.tokens) > 1

    @property
    def picked(self) -> int:
        """How many of its tokens' outputs it takes."""
        return 1 if self.want in (Want.LAST, Want.TOKEN) else len(self.tokens)


def decode_lanes(tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int]) -> list[Lane]:
    """A decode step's lanes: each sequence's one token at its position."""
    return [Lane(s, p, [t], Want.LAST, decoding=True) for t, s, p in zip(tokens, slots, positions, strict=True)]


def pick_of(row: np.ndarray) -> np.ndarray:
    """A TOKEN lane's output from its last logits row: their argmax, an int32 array (1,)."""
    return np.array([np.argmax(row)], np.int32)
