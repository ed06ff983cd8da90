"""The maximal-update parametrization (model.parametrization=mup; Yang & Hu 2021, Yang et al. 2022 "Tensor
Programs V", its Table 8 form: Adam, fan-in init, multipliers on the attention logits and the readout).

Widths are measured against a base shape, the model the hyper-parameters were tuned at:

    m_d = hidden_size / mup_base_width                  (the model width)
    m_s = shared_width / mup_base_shared_width          (the shared expert's width, its own dimension)
    m_r = routed_width / mup_base_routed_width          (the routed experts' width; E fixed, so this is
                                                         also expert_width / its base)

A hidden matrix (finite fan-in and fan-out both grow with width) with fan-in multiplier m gets

    init std  = sp std / sqrt(m)        (variance ~ 1 / fan_in)
    lr        = lr / m                  (Adam's update is ~lr per entry: its effect on the output ~ fan_in)
    weight_decay = weight_decay * m     (torch multiplies the decay by lr: lr * wd stays the base's)

fan-in multipliers: qkv, attention out, shared w_in and routed w_in read the hidden state (m_d); shared w_out
reads the shared width (m_s); routed w_out reads one expert's width (m_r). A dense layer's widened shared
expert (width S + K W_e, trmoe/model/moe.py) has its own base, the same sum at the base shape: its w_out's
multiplier is m_dense = (S + K W_e) / (S / m_s + K W_e / m_r) (= m_d with the default bases). The tied
embedding is the input layer (vector-like: init std and lr unchanged) and also the readout: the readout's
1/m_d multiplier goes on the final hidden state (logits = (RMSNorm(h) / m_d) @ E^T), which keeps the readout's
weight vector-like as microsoft/mup's MuSharedReadout does. Attention logits are q.k * sqrt(d_0) / d (1/d
scaling, equal to SP's 1/sqrt(d) at the base head dim d_0 = mup_base_width / num_heads). Norm weights, the
scalar gates g_s, g_r and the fixed per-layer scales a, b have no width dimension: unchanged. Depth is not a
muP dimension here: the residual writers keep their 1/sqrt(2L) init factor. docs/mup.md tabulates all of it.

With every multiplier 1 (parametrization=sp, or mup at the base shape) the model is exactly the sp model.
"""

from __future__ import annotations

import math
import re

from trmoe.model.spec import ModelSpec

# parameter-name suffixes of the hidden matrices, by the width their fan-in follows
_READS_HIDDEN = ("attn.qkv.weight", "attn.out.weight", "shared.w_in", "routed.w_in")
_LAYER = re.compile(r"blocks\.(\d+)\.ffn\.shared\.w_out$")


def dense_mult(spec: ModelSpec) -> float:
    """m_dense of the module docstring: a dense layer's SwiGLU width over its width at the base shape."""
    base = spec.top_k * spec.expert_width / spec.mup_routed_mult
    if spec.shared_width:
        base += spec.shared_width / spec.mup_shared_mult
    return spec.dense_width / base


def fan_in_mult(name: str, spec: ModelSpec) -> float:
    """m of the parameter `name` (a TRMoETransformer parameter name): the growth of its fan-in over the base
    shape for a hidden matrix under mup; 1 for everything else and for every parameter under sp."""
    if spec.parametrization != "mup":
        return 1.0
    if name.endswith(_READS_HIDDEN):
        return spec.mup_width_mult
    if name.endswith("shared.w_out"):
        layer = _LAYER.search(name)
        if layer is not None and spec.is_dense(int(layer.group(1))):
            return dense_mult(spec)
        return spec.mup_shared_mult
    if name.endswith("routed.w_out"):
        return spec.mup_routed_mult
    return 1.0


def attention_scale(spec: ModelSpec) -> float | None:
    """The attention logits' scale: None (SDPA's 1/sqrt(d)) under sp; sqrt(d_0) / d under mup."""
    if spec.parametrization != "mup":
        return None
    return math.sqrt(spec.mup_base_head_dim) / spec.head_dim


def output_mult(spec: ModelSpec) -> float:
    """The readout multiplier on the final hidden state: 1 under sp, 1 / m_d under mup."""
    return 1.0 / spec.mup_width_mult if spec.parametrization == "mup" else 1.0
