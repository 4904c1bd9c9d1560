"""Qwen2 and Qwen3: the llama-family layer with rotary pairs split in halves. Qwen2's q/k/v biases and
Qwen3's q/k norms are read from the tensors a file has, so the two are one record under two names.
Qwen2-VL and Qwen2.5-VL (llama.cpp's qwen2vl) are Qwen2, Qwen3-VL (qwen3vl, qwen3vlmoe) Qwen3 and
Qwen3-MoE, whose rotary pairs an image's rows turn by M-RoPE sections: time, row and column
(model/rope.py); Qwen3-VL's image rows carry deepstack features its first layers add (config's
deepstack_layers)."""

from webapp.engine.archs.record import Architecture, Experts, MRope

ARCHITECTURES = (
    Architecture(("qwen2", "qwen3")),
    Architecture(("qwen2vl",), mrope=MRope.SECTIONS),
    Architecture(("qwen3vl",), mrope=MRope.INTERLEAVED),
    Architecture(("qwen3vlmoe",), mrope=MRope.INTERLEAVED, experts=Experts.ALWAYS, expert_weights_norm=True),
)
