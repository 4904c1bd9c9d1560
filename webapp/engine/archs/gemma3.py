"""Gemma 3: q/k norms, five of six layers a sliding window rotated by their own fixed RoPE base
(llama.cpp's rope_freq_base_train_swa), post-norms, GeGLU and an embedding times sqrt(dim).

Gemma 3 27B scales attention by its width per head, dim / heads (query_pre_attn_scalar), not by its
head size, as llama.cpp does; its files say so only by their layer count.
"""

from webapp.engine.archs.record import Architecture, with_layers

is_gemma3_27b = with_layers(62)  # Gemma 3 27B; the other sizes have 26, 34 and 48 layers


ARCHITECTURES = (
    Architecture(
        ("gemma3",),
        sliding_window_every=6,
        local_rope_base=10000.0,
        score_scale_by_width=is_gemma3_27b,
        scaled_embedding=True,
        post_norms=True,
        geglu=True,
    ),
)
