"""Every per-step schedule of a run, each a pure function of (step, config).

The step is the 1-based optimizer step. Nothing here keeps state, so a resumed run needs only its step
to be back on the same curves, and `check_extension` can tell whether a changed config (for example a
larger `trainer.steps`) would alter the part of the schedules that already ran.

The horizon H of all schedules is `optimizer.decay_steps`, or `trainer.steps` when that is not set:

    LR multiplier   at step s the curve's value at c = s - optimizer.schedule_offset (0 by default; the
                    old runner's LambdaLR is offset 1: step 1 at c = 0, LR 0, the last at c = H - 1):
                    warmup W (default 5% of H): c / W for c <= W, then
                      cosine:   floor + (1 - floor) * (1 + cos(pi * x)) / 2,  x = (c - W) / (H - W)
                      wsd:      1 until D = H - round(f * H),
                                then floor + (1 - floor) * shape((c - D) / (H - D))
                      constant: 1
                    and the floor once c >= H (cosine, wsd).
    ramps           value(s) = start + (final - start) * shape(min(1, (s - 1) / R)),  R = round(ramp * H);
                    R = 0 means `final` from step 1. Used by the top-k primary weight p, the scheduled
                    gates and the diversity weight lambda. Each is off unless configured.

`optimizer.schedule_rounding=floor` turns every "round" above (the default warmup, WSD's decay length, the
ramps' R: steps made from a share of H) into the old runner's int(share * H), and a ramp of R <= 1 into
none (R = 0).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trmoe.config.schema import (
    Config,
    DecayShape,
    LRSchedule,
    OptimizerConfig,
    RampShape,
    ScheduleRounding,
)
from trmoe.errors import UserError


def horizon(o: OptimizerConfig, total_steps: int) -> int:
    """The schedule horizon: optimizer.decay_steps, or trainer.steps when it is not set."""
    return o.decay_steps if o.decay_steps is not None else total_steps


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


@dataclass(frozen=True)
class LRCurve:
    kind: str  # cosine | constant | wsd
    warmup: int  # linear warmup steps
    horizon: int  # cosine / wsd reach the floor here
    floor: float  # min_lr_ratio
    decay_start: int  # wsd: last step at the peak (the decay runs from here to the horizon)
    decay_shape: str  # wsd: linear | cosine | sqrt
    offset: int = 0  # step s is the curve's step s - offset (before the field existed: 0)

    def __call__(self, step: int) -> float:
        step = max(0, step - self.offset)  # offset 1: the first step at the curve's 0, LR 0 (the old runner)
        if self.warmup > 0 and step <= self.warmup:
            return step / self.warmup  # so step 1 already moves (offset 0)
        if self.kind == LRSchedule.constant.value:
            return 1.0
        if self.kind == LRSchedule.cosine.value:
            x = min(1.0, (step - self.warmup) / max(1, self.horizon - self.warmup))
            return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * x))
        # wsd
        if step <= self.decay_start:
            return 1.0
        x = min(1.0, (step - self.decay_start) / max(1, self.horizon - self.decay_start))
        return self.floor + (1.0 - self.floor) * _decay(self.decay_shape, x)


def _decay(shape: str, x: float) -> float:
    """1 at x=0, 0 at x=1."""
    if shape == DecayShape.linear.value:
        return 1.0 - x
    if shape == DecayShape.cosine.value:
        return 0.5 * (1.0 + math.cos(math.pi * x))
    return 1.0 - math.sqrt(x)


@dataclass(frozen=True)
class Ramp:
    start: float
    final: float
    steps: int  # R: the ramp covers steps 1 .. R + 1
    shape: str  # linear | cosine

    def __call__(self, step: int) -> float:
        x = 1.0 if self.steps <= 0 else min(1.0, max(0, step - 1) / self.steps)
        if self.shape == RampShape.cosine.value:
            x = 0.5 * (1.0 - math.cos(math.pi * x))
        return self.start + (self.final - self.start) * x


def lr_curve(cfg: Config) -> LRCurve:
    return lr_curve_of(cfg.optimizer, cfg.trainer.steps)


def steps_of(o: OptimizerConfig, share: float, h: int) -> int:
    """The steps a share of the horizon h makes under optimizer.schedule_rounding: round, or the old
    runner's int(share * h) (the same float product as its `steps * ratio`, so the same truncation)."""
    if o.schedule_rounding == ScheduleRounding.floor:
        return math.floor(share * h)
    return round(share * h)


def lr_curve_of(o: OptimizerConfig, total_steps: int) -> LRCurve:
    h = horizon(o, total_steps)
    warmup = o.warmup_steps if o.warmup_steps is not None else max(1, steps_of(o, 0.05, h))
    decay_start = h - steps_of(o, o.wsd_decay_fraction, h)
    return LRCurve(
        kind=o.schedule.value,
        warmup=max(warmup, 0),
        horizon=h,
        floor=o.min_lr_ratio,
        decay_start=max(decay_start, warmup),
        decay_shape=o.wsd_decay_shape.value,
        offset=o.schedule_offset,
    )


def _ramp(cfg: Config, start: float, final: float | None, fraction: float, shape: RampShape) -> Ramp | None:
    if final is None:
        return None
    o = cfg.optimizer
    steps = steps_of(o, fraction, horizon(o, cfg.trainer.steps))
    if o.schedule_rounding == ScheduleRounding.floor and steps <= 1:
        steps = 0  # the old runner: a ramp of <= 1 step is the final value from step 1
    return Ramp(start=float(start), final=float(final), steps=steps, shape=shape.value)


@dataclass(frozen=True)
class Schedules:
    """All per-step values of a run. A None member is off: the value stays what the config says."""

    lr: LRCurve
    primary_weight: Ramp | None  # top-k primary weight p
    shared_gate: Ramp | None  # g_s when scheduled (then not learned)
    routed_gate: Ramp | None  # g_r when scheduled (then not learned)
    diversity: Ramp | None  # lambda of the expert-diversity penalty

    def at(self, step: int) -> dict[str, float | None]:
        return {
            "lr_mult": self.lr(step),
            "primary_weight": None if self.primary_weight is None else self.primary_weight(step),
            "shared_gate": None if self.shared_gate is None else self.shared_gate(step),
            "routed_gate": None if self.routed_gate is None else self.routed_gate(step),
            "diversity": None if self.diversity is None else self.diversity(step),
        }

    def to_dict(self) -> dict:
        """Recorded in run_config.json as the resolved schedules."""
        return {k: (None if v is None else asdict(v)) for k, v in self.__dict__.items()}


def build_schedules(cfg: Config) -> Schedules:
    m, r, loss = cfg.model, cfg.routing, cfg.loss
    p_final = r.primary_weight_final if r.top_k > 1 else None
    diversity = None
    if loss.diversity_weight > 0:  # ramps up from 0 when diversity_ramp > 0
        start = 0.0 if loss.diversity_ramp > 0 else loss.diversity_weight
        diversity = _ramp(cfg, start, loss.diversity_weight, loss.diversity_ramp, loss.diversity_ramp_shape)
    p = _ramp(cfg, r.primary_weight, p_final, r.primary_weight_ramp, r.primary_weight_ramp_shape)
    return Schedules(
        lr=lr_curve(cfg),
        primary_weight=p,
        shared_gate=_ramp(cfg, m.shared_gate_init, m.shared_gate_final, m.gate_ramp, m.gate_ramp_shape),
        routed_gate=_ramp(cfg, m.routed_gate_init, m.routed_gate_final, m.gate_ramp, m.gate_ramp_shape),
        diversity=diversity,
    )


def check_extension(done: Schedules, new: Schedules, steps_done: int) -> None:
    """Raise UserError if `new` differs from `done` at any step 1..steps_done, i.e. if resuming a run
    that completed `steps_done` steps under `done` with the schedules `new` would bend what already ran.

    Extending `trainer.steps` keeps the past intact when the horizon is pinned (`optimizer.decay_steps`
    set to the old horizon, warmup pinned by `optimizer.warmup_steps`); WSD may also move its horizon
    while the run is still in the stable phase."""
    for step in range(1, steps_done + 1):
        a, b = done.at(step), new.at(step)
        for key in a:
            if not _close(a[key], b[key]):
                raise UserError(
                    f"config error: schedules: {key} at step {step} would change from {a[key]} to {b[key]} "
                    f"(the run already did {steps_done} steps); keep the schedule of the steps done, e.g. "
                    f"optimizer.decay_steps={done.lr.horizon} optimizer.warmup_steps={done.lr.warmup}"
                )


def apply_lr(optimizer, multiplier: float) -> None:
    """Every group's lr is its base_lr times the one multiplier (no optimizer keeps a schedule of its own)."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier
