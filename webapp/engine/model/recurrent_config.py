"""Qwen3.5's hybrid layers (llama.cpp's `qwen35`) as the GGUF file describes them: Gated DeltaNet
recurrent layers beside gated full-attention ones, three to one in the released models.

Contract: `recurrent_sizes(kv, arch, n_layers, count)` reads the `ssm.*` keys into `Recurrent` or
raises ModelLoadError naming the key at fault; `Recurrent.layer(i)` says whether layer i is
recurrent; `recurrent_tensor_shapes(config, p, i)` gives layer i's tensors but its feed-forward's
(a full layer's q rows are each head's query then its output gate: twice the heads' width).

A recurrent layer keeps no keys and values a position: its state is a fixed size a sequence (the
conv's last kernel - 1 inputs and an S x S matrix a value head: `state_floats`), so a slot's memory
for it does not grow with the context, and a cached prefix is reusable only where a state is that
prefix's: the slot's own, at the end of everything it ran, or a snapshot of it taken where a prompt
chunk ended (`snapshot_rows(slots)` more rows of state, serving/state_snapshots.py). Drafted tokens
run in `draft_state_rows` of their own, so that a refused one can be left behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from webapp.engine.model.load_error import ModelLoadError

# Rows of state kept beside the slots' own for snapshots: a chat's turn takes one where its last user
# message starts and one where its generation prompt starts (the system prompt's end is mostly held
# already), and its next turn, an edit or a regeneration comes back to them
SNAPSHOTS_PER_SLOT = 2

LIMITS = {"ssm.conv_kernel": 16, "ssm.state_size": 512, "ssm.group_count": 256, "ssm.time_step_rank": 256}


@dataclass(frozen=True)
class Recurrent:
    conv_kernel: int  # the conv's width: this input and kernel - 1 before it (ssm.conv_kernel)
    state: int  # a head's keys' and values' size (ssm.state_size)
    k_heads: int  # the query and key heads (ssm.group_count)...
    v_heads: int  # ...and the value heads, a multiple of them (ssm.time_step_rank)
    pattern: tuple[bool, ...]  # which layers are recurrent

    def layer(self, i: int) -> bool:
        return self.pattern[i]

    @property
    def conv_rows(self) -> int:
        """The conv's channels: q's, k's and v's values."""
        return (2 * self.k_heads + self.v_heads) * self.state

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.state

    @property
    def state_floats(self) -> int:
        """A sequence's state in one recurrent layer, float32 values (gated_delta.c's row of a slot)."""
        return (self.conv_kernel - 1) * self.conv_rows + self.v_heads * self.state * self.state

    @property
    def first_attention(self) -> int:
        return self.pattern.index(False)


# Rows of state for a step's drafted tokens (speculative decoding), after the snapshots': each drafted
# token runs in a row of its own, taking over the state the token before it left (gated_delta.c's
# lane rows), so a refused draft leaves the state of the last confirmed token in its row. A step
# drafts no more tokens than these rows (serving/speculation.py).
DRAFT_STATE_ROWS = 8


def snapshot_rows(slots: int) -> int:
    """How many snapshots of a state the cache keeps, after the slots' rows and the scratch one."""
    return SNAPSHOTS_PER_SLOT * slots


def spare_state_rows(slots: int) -> int:
    """The rows of state beside the slots' and the scratch one: the snapshots', then the drafts'."""
    return snapshot_rows(slots) + DRAFT_STATE_ROWS


def draft_state_rows(slots: int) -> range:
    """The rows a step's drafted tokens run in (DRAFT_STATE_ROWS)."""
    first = slots + 1 + snapshot_rows(slots)
    return range(first, first + DRAFT_STATE_ROWS)


def recurrent_sizes(kv: dict, arch: str, n_layers: int, count) -> Recurrent:
    """The file's ssm.* keys; `count(key, default, low)` reads a whole number in range (config.py's)."""

    sizes = {}
    for key in LIMITS:
        sizes[key] = count(key)
        if sizes[key] > LIMITS[key]:
            raise ModelLoadError(f"GGUF metadata {arch}.{key} = {sizes[key]}: more than {LIMITS[key]}")
    kernel, state, k_heads, v_heads = sizes.values()
    if kernel < 2 or state % 8 or v_heads % k_heads:
        raise ModelLoadError(
            f"GGUF metadata {arch}.ssm.*: a conv of {kernel}, heads of {state} values and {v_heads} value heads over {k_heads} key heads "
            "(expected a conv of 2 or more, heads of a multiple of 8 values, value heads a multiple of the key heads)"
        )
    inner = count("ssm.inner_size")
    if inner != v_heads * state:
        raise ModelLoadError(f"GGUF metadata {arch}.ssm.inner_size = {inner}: expected {v_heads} value heads of {state} values")
    listed = kv.get(f"{arch}.attention.recurrent_layers")
    if listed is not None:
        if not isinstance(listed, list) or len(listed) < n_layers:
            raise ModelLoadError(f"GGUF metadata {arch}.attention.recurrent_layers: expected a flag for each of the {n_layers} layers")
        pattern = tuple(bool(flag) for flag in listed[:n_layers])
    else:
        every = count("full_attention_interval", 4)
        pattern = tuple((i + 1) % every != 0 for i in range(n_layers))
    if all(pattern):
        raise ModelLoadError(f"GGUF metadata {arch}: every layer is recurrent; a hybrid with no attention layer is not supported")
    return Recurrent(kernel, state, k_heads, v_heads, pattern)


def recurrent_tensor_shapes(config, p: str, layer: int) -> dict[str, tuple[int, int]]:
    """Layer `layer`'s tensors but its feed-forward's, as (rows, cols) (a vector one row)."""
    r, D = config.recurrent, config.dim
    shapes = {p + "attn_norm.weight": (1, D), p + config.ffn_norm_name: (1, D)}
    if r.layer(layer):
        C, V, Hv = r.conv_rows, r.value_dim, r.v_heads
        shapes |= {p + "attn_qkv.weight": (C, D), p + "attn_gate.weight": (V, D), p + "ssm_conv1d.weight": (C, r.conv_kernel)}
        shapes |= {p + "ssm_beta.weight": (Hv, D), p + "ssm_alpha.weight": (Hv, D), p + "ssm_dt.bias": (1, Hv), p + "ssm_a": (1, Hv)}
        return shapes | {p + "ssm_norm.weight": (1, r.state), p + "ssm_out.weight": (D, V)}
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    shapes |= {p + "attn_q.weight": (2 * q, D), p + "attn_k.weight": (kv, D), p + "attn_v.weight": (kv, D)}
    shapes |= {
        p + "attn_output.weight": (D, q),
        p + "attn_q_norm.weight": (1, config.head_dim),
        p + "attn_k_norm.weight": (1, config.head_dim),
    }
    return shapes
