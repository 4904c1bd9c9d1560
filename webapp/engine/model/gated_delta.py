"""Qwen3.5's token mixers (llama.cpp's `qwen35`, `qwen35moe`): the Gated DeltaNet recurrence
(`GatedDeltaNet`) beside full attention whose output a gate scales (`GatedAttention`), mixers as
attention.py states them; each layer holds one beside its feed-forward: a dense SwiGLU, or a
mixture of experts with a gated shared expert (feed_forward.py, routed.py).

Contract: both fill Attention's hooks for the CPU kernels' whole-model step (the
kernels' gated_delta.c says what they compute); with n = rms_norm(x) * attn_norm:
    recurrent: [mixed | z | beta | alpha] = W_qkv . n  (attn_qkv, attn_gate, ssm_beta, ssm_alpha stacked)
               h = x + W_ssm_out . gated_delta_net(...)
    full:      [q_h | gate_h for each head h] | k | v = W_qkv . n;  h = x + W_o . (attention * sigmoid(gate))
A recurrent mixer's cache is its state, float32 (1, slots + 1 + spare_state_rows(slots), 1, 1,
Recurrent.state_floats): every slot's conv inputs and S x S matrices, whatever the context, the
scratch slot's, then the snapshots' (serving/state_snapshots.py) and the drafted tokens'
(recurrent_config.draft_state_rows). The layers run only inside the kernels'
one call (every product in blocks, on the CPU): tinygrad's path and the five-kernel fallback have no
recurrence, and the file is refused there in one line (transformer.load_model).
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes

from webapp.engine.kernels import abi
from webapp.engine.kernels.abi import AttendFlag
from webapp.engine.model.attention import Attention, zero_pages
from webapp.engine.model.kv_types import KvPool, KvRows
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.products import float32_buffer
from webapp.engine.model.recurrent_config import spare_state_rows
from webapp.engine.model.weights import WeightSource

ONLY_ON_KERNELS = "Qwen3.5's layers run only on the CPU kernels' one-call step (the CPU device, LLM_CPU_KERNELS on)"


class _KernelsOnly(Attention):
    # a layer the kernels cannot run (a head over MAX_HEAD_DIM) would take tinygrad's path, which has
    # none of these layers; load_model refuses a model whose step is not the kernels' one call
    def _load_tinygrad_attention(self, weights: WeightSource, p: str) -> None:
        raise ModelLoadError(ONLY_ON_KERNELS)


class GatedAttention(_KernelsOnly):
    """Attention with q/k norms and a partial rotary whose output is times sigmoid(gate): the file's q
    rows carry each head's gate after its query, which the kernels take apart."""

    form = int(abi.LayerForm.GATED_ATTENTION)


class GatedDeltaNet(_KernelsOnly):
    recurrent = True
    form = int(abi.LayerForm.RECURRENT)

    def _load_products(self, weights: WeightSource, p: str) -> None:
        # the four products of the normed input as one
        self.qkv = weights.linear(p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight", p + "ssm_alpha.weight")
        self.attn_output = weights.linear(p + "ssm_out.weight")  # Hv S -> D
        self._extra_names = [p + "ssm_conv1d.weight", p + "ssm_dt.bias", p + "ssm_a", p + "ssm_norm.weight"]

    def _kernel_attention(self, weights: WeightSource, p: str) -> tuple[Tensor, int]:
        return float32_buffer(weights, self._extra_names), int(AttendFlag(0))

    def make_cache(self, slots: int, context: int, step_writes: int, pool: KvPool | None, kv_type: KvRows) -> None:
        self.kv_type = kv_type
        if pool is not None:
            raise ModelLoadError("a recurrent layer's state has no blocks to page: qwen35 keeps slots (LLM_KV_LAYOUT=slots)")
        self.positions, self.ring = 1, False
        rows = slots + 1 + spare_state_rows(slots)
        self.cache = zero_pages((1, rows, 1, 1, self.c.recurrent.state_floats), dtypes.float32)

    def kernel_extras(self) -> dict:
        r = self.c.recurrent
        return {"recurrent": abi.Recurrent(r.conv_kernel, r.state, r.k_heads, r.v_heads)}
