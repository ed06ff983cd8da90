"""Training FLOPs per token of a TR-MoE model: the one formula the planner (`python -m trmoe.plan`) and the
step benchmark (`python -m trmoe.bench step`, its MFU) share.

Per token, forward + backward (backward = 2 x forward):

    dense     = 6 x N_active_nonemb       every GEMM weight a token passes through: 2 FLOPs per weight in
                                          the forward, 4 in the backward. N_active_nonemb = active
                                          parameters minus the tied embedding (a routed layer counts the K of
                                          E experts a token visits; the dispatch does exactly K x tokens
                                          expert rows of work). Norm weights and gates are included (no GEMM
                                          weights, but < 0.07% of it from 50m up; 0.35% at tiny).
    attention = 6 x L x S x d_attn        causal scores Q K^T and the weighted sum A V: 2 x 2 x S x d_attn
                                          per token and layer over the full S x S square, x 3 for the
                                          backward, halved for the causal mask (flash kernels skip the upper
                                          triangle). d_attn = num_heads x head_dim (query heads: GQA/MQA
                                          share keys and values but not these FLOPs). PaLM's MFU convention
                                          counts the full square (12 x L x S x d_attn) instead.
    head      = 6 x H x V_rows            the tied output head: the logits GEMM and its two gradient GEMMs
                                          over every embedding row (model.vocab_pad_multiple padding
                                          included, it is computed too). The embedding lookup is no GEMM.

    flops_per_token = dense + attention + head

Evaluation, norms, softmax and the optimizer are not counted (they are not GEMMs). Checked against torch's
FlopCounterMode on a real forward and backward in tests/test_plan.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch import at run time: the run reports use flops_terms on recorded numbers
    from trmoe.model.transformer import ModelSpec, ParamCounts


# Dense datasheet peaks per device (FLOP/s): bf16 tensor-core, and plain fp32 (no TF32), matched by a
# substring of the device name. The live MFU (metrics.csv), the run report and `trmoe.bench step` use them;
# `hardware.peak_tflops` (or the report's --peak-tflops) overrides them, and any other device is measured.
DATASHEET_PEAKS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250e12, "fp32": 80e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "A10G": {"bf16": 70e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
    "MI300X": {"bf16": 1307e12, "fp32": 163.4e12},
    "MI250X": {"bf16": 383e12, "fp32": 47.9e12},
}


def datasheet_peak(device_name: str, precision: str) -> float | None:
    """The datasheet peak of a known GPU for `precision` ("bf16"/"fp16" use the bf16 figure), else None."""
    column = "fp32" if precision in ("fp32", "float32") else "bf16"
    for key, peaks in DATASHEET_PEAKS.items():
        if key in device_name:
            return peaks[column]
    return None


@dataclass(frozen=True)
class FlopsPerToken:
    dense: int  # 6 x active non-embedding parameters
    attention: int  # 6 x L x S x d_attn (causal)
    head: int  # 6 x H x embedding rows (tied head)

    @property
    def total(self) -> int:
        return self.dense + self.attention + self.head

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def flops_terms(
    *,
    active: int,
    embedding: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    hidden_size: int,
    embedding_rows: int,
    seq_len: int,
) -> FlopsPerToken:
    """The three terms of the module docstring from plain numbers (a run record holds these)."""
    return FlopsPerToken(
        dense=6 * (active - embedding),
        attention=6 * num_layers * seq_len * num_heads * head_dim,
        head=6 * hidden_size * embedding_rows,
    )


def flops_breakdown(spec: ModelSpec, params: ParamCounts, seq_len: int) -> FlopsPerToken:
    """The three terms of the module docstring, for sequences of `seq_len` tokens."""
    return flops_terms(
        active=params.active,
        embedding=params.embedding,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        embedding_rows=spec.embedding_rows,
        seq_len=seq_len,
    )


def flops_per_token(spec: ModelSpec, params: ParamCounts, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): dense + attention + head, see the module docstring."""
    return flops_breakdown(spec, params, seq_len).total
