"""Qwen2 and Qwen3: the llama-family layer with rotary pairs split in halves. Qwen2's q/k/v biases and
Qwen3's q/k norms are read from the tensors a file has, so the two are one record under two names."""

from webapp.engine.archs.record import Architecture

ARCHITECTURES = (Architecture(("qwen2", "qwen3")),)
