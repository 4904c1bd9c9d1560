"""OLMo 2 (Ai2): no input norms; each sublayer reads the residual stream as it is and its output is
rms-normed before it is added (post-norms only), q and k are normed over all their heads at once (as
OLMoE's), rotary pairs split in halves."""

from webapp.engine.archs.record import Architecture

ARCHITECTURES = (Architecture(("olmo2",), qk_norm_whole=True, post_norms=True, input_norms=False),)
