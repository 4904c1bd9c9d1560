"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, routed experts whose
probabilities weigh them as they are, and a shared expert behind a sigmoid gate (ffn_gate_inp_shexp)."""

from webapp.engine.archs.record import Architecture, Experts

ARCHITECTURES = (Architecture(("qwen2moe",), experts=Experts.ALWAYS, shared_expert=True),)
