"""Qwen3-MoE: Qwen3's attention, then a mixture of experts whose chosen weights are divided by their
sum (norm_topk_prob, as llama.cpp builds it)."""

from webapp.engine.archs.record import Architecture, Experts

ARCHITECTURES = (Architecture(("qwen3moe",), experts=Experts.ALWAYS, expert_weights_norm=True),)
