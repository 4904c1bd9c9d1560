"""Phi-3: q, k and v stored as one matrix (read from the file's attn_qkv), gate and up as one (ffn_up,
gate first, which its files do not name apart), a partial rotary and LongRoPE (rope.py)."""

from webapp.engine.archs.record import Architecture

ARCHITECTURES = (Architecture(("phi3",), fused_gate_up=True),)
