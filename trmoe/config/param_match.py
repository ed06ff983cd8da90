"""Parameter matching: solve one FFN width so the whole model has a target number of trainable parameters.

Every arm of a matched grid names the same `model.match_params`; each solves its own width
(`model.match_field`, a multiple of `model.match_multiple`) at config-resolution time. `model.match_count`
says which count is matched: `total` (every trainable parameter; the default) or `active` (the parameters a
token uses: a routed layer's K of E experts, its router or combine gate, every dense layer whole). Either
count is linear in either width (for width > 0: a SwiGLU of width W over hidden size H holds 3·H·W weights
per layer, of which a routed expert's K/E are active), so two counts give the slope and the solution follows
directly:

    count(W) = base + slope · W / step          W = step · round((target - base) / slope)

Grids that mix dense layers (routing.layers' `dense`) with routed ones match `active`: a dense layer has the
routed layer's active FFN (shared + K x expert width) but not its E - K idle experts, so a total match would
widen it far past the routed layers' compute.

Counts come from `parameter_counts(model_spec(cfg))` (the model built on the meta device), never from a
formula kept in step by hand. The solution is exact when the target lies on the grid of multiples, else the
closest multiple wins and its residual (total - target) is reported.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from trmoe.config.schema import Config, MatchCount, MatchField
from trmoe.config.spec import model_spec
from trmoe.errors import UserError


@dataclass(frozen=True)
class MatchSolution:
    target: int  # model.match_params
    field: str  # the solved key, "shared_width" or "routed_width"
    count: str  # the matched count, "total" or "active" (model.match_count)
    width: int  # the solved value of model.<field>
    step: int  # the width grid: match_multiple, or lcm(match_multiple, num_experts) for routed_width
    total: int  # trainable parameters at the solved width
    active: int  # parameters a token uses at the solved width
    residual: int  # the matched count - target; 0 when exact

    @property
    def exact(self) -> bool:
        return self.residual == 0

    def to_dict(self) -> dict:
        return {**asdict(self), "exact": self.exact}

    def describe(self) -> str:
        how = "exact" if self.exact else f"closest multiple of {self.step}, residual {self.residual:+,}"
        what = "parameters" if self.count == "total" else "active parameters"
        return f"model.{self.field}={self.width} for {self.target:,} {what} ({how})"


def _with_width(cfg: Config, field: str, width: int) -> Config:
    return replace(cfg, model=replace(cfg.model, **{field: width}))


def _counts(cfg: Config, field: str, width: int):
    from trmoe.model.transformer import parameter_counts  # torch: only a config that matches pays for it

    return parameter_counts(model_spec(_with_width(cfg, field, width)))


def width_step(cfg: Config) -> int:
    """The grid the solved width lives on: match_multiple, and for routed_width also a multiple of E."""
    m = cfg.model
    if MatchField(m.match_field) == MatchField.routed_width and m.num_experts >= 1:
        return math.lcm(m.match_multiple, m.num_experts)  # each of the E experts gets routed_width / E
    return m.match_multiple


def ignore_solved_width(cfg: Config) -> None:
    """Before validation: the configured value of the width that will be solved is ignored (the profile's
    value means nothing under matching), so it is set to a valid placeholder, the first grid point."""
    m = cfg.model
    if m.match_params is not None and m.match_multiple >= 1:
        setattr(m, MatchField(m.match_field).value, width_step(cfg))


def solve_match(cfg: Config) -> MatchSolution | None:
    """The width that brings the total parameter count to `model.match_params` (None when that is unset).
    Only the other fields of cfg matter: the current value of the solved width is ignored."""
    m = cfg.model
    if m.match_params is None:
        return None
    field = MatchField(m.match_field).value
    count = MatchCount(m.match_count).value
    step = width_step(cfg)
    target = m.match_params

    low, high = (getattr(_counts(cfg, field, w), count) for w in (step, 2 * step))
    slope = high - low  # parameters per `step` of width
    if slope <= 0:  # cannot happen for a SwiGLU width; guards the division below
        raise UserError(f"config error: model.match_field={field}: the parameter count does not grow with it")
    if target < low:
        raise UserError(
            f"config error: model.match_params={target}: below the smallest model with model.{field}="
            f"{step} ({low:,} {count} parameters); allowed: >= {low}"
        )
    base = low - slope  # the line through the two counts, extended to width 0
    k = (target - base) / slope
    best = None
    for steps in sorted({max(1, math.floor(k)), max(1, math.ceil(k))}):
        counts = _counts(cfg, field, steps * step)
        candidate = MatchSolution(
            target=target,
            field=field,
            count=count,
            width=steps * step,
            step=step,
            total=counts.total,
            active=counts.active,
            residual=getattr(counts, count) - target,
        )
        # The smaller |residual| wins; on a tie, the model below the target.
        if best is None or (abs(candidate.residual), candidate.residual) < (
            abs(best.residual),
            best.residual,
        ):
            best = candidate
    return best


def apply_match(cfg: Config) -> MatchSolution | None:
    """Solve and write the width into cfg.model (in place). Returns the solution, or None when unset."""
    solution = solve_match(cfg)
    if solution is not None:
        setattr(cfg.model, solution.field, solution.width)
    return solution
