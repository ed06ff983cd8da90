"""Schedules: LR (cosine, constant, WSD) at known steps, an explicit horizon so that extending a run does
not bend what already ran, and the optional ramps of p, the gates and the diversity weight (off unless
configured)."""

from __future__ import annotations

import csv
import math
from dataclasses import replace

import pytest
import torch
from helpers import compose_config
from presets import FAST_CPU

from trmoe.config.resolve import to_config
from trmoe.config.schema import DiversityTarget, ScheduleRounding
from trmoe.config.spec import model_spec
from trmoe.errors import UserError
from trmoe.model.transformer import TRMoETransformer
from trmoe.optim.schedule import build_schedules, check_extension
from trmoe.train.diversity import expert_diversity
from trmoe.train.loop import train

FAST = [
    *FAST_CPU,
    "trainer.micro_batch=2",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def schedules(*overrides: str):
    return build_schedules(to_config(compose_config("data=random", *overrides)))


def rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))[1:]


def test_cosine_at_known_steps():
    lr = schedules("trainer.steps=100", "optimizer.warmup_steps=10", "optimizer.min_lr_ratio=0.1").lr
    assert lr(1) == pytest.approx(0.1) and lr(5) == pytest.approx(0.5) and lr(10) == pytest.approx(1.0)
    assert lr(55) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert lr(100) == pytest.approx(0.1) and lr(150) == pytest.approx(0.1)  # the floor, also beyond


def test_default_warmup_is_five_percent_of_the_horizon():
    assert schedules("trainer.steps=200").lr.warmup == 10
    assert schedules("trainer.steps=200", "optimizer.decay_steps=400").lr.warmup == 20


def test_constant_after_warmup():
    lr = schedules("trainer.steps=50", "optimizer.schedule=constant", "optimizer.warmup_steps=4").lr
    assert [lr(s) for s in (1, 4, 5, 50)] == pytest.approx([0.25, 1.0, 1.0, 1.0])


@pytest.mark.parametrize(
    "shape,mid", [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))]
)  # value of the decay function halfway
def test_wsd_warms_up_holds_then_decays_to_the_floor(shape, mid):
    lr = schedules(
        "trainer.steps=100",
        "optimizer.schedule=wsd",
        "optimizer.warmup_steps=10",
        "optimizer.wsd_decay_fraction=0.2",
        f"optimizer.wsd_decay_shape={shape}",
        "optimizer.min_lr_ratio=0.0",
    ).lr
    assert lr(5) == pytest.approx(0.5)
    assert lr(10) == lr(50) == lr(80) == 1.0  # stable until the last 20% of the horizon
    assert lr(90) == pytest.approx(mid)
    assert lr(100) == pytest.approx(0.0) and lr(81) < 1.0


def test_extending_steps_keeps_the_past_only_with_a_pinned_horizon():
    done = schedules("trainer.steps=100", "optimizer.warmup_steps=10")
    with pytest.raises(UserError, match="optimizer.decay_steps=100 optimizer.warmup_steps=10"):
        check_extension(done, schedules("trainer.steps=200", "optimizer.warmup_steps=10"), steps_done=60)
    pinned = schedules("trainer.steps=200", "optimizer.decay_steps=100", "optimizer.warmup_steps=10")
    check_extension(done, pinned, steps_done=60)  # the first 60 steps are unchanged
    assert pinned.lr(150) == pytest.approx(0.1)  # the extra steps run at the floor
    # the default warmup is 5% of the horizon: it moves with the horizon unless pinned
    with pytest.raises(UserError, match="lr_mult at step 1"):
        check_extension(schedules("trainer.steps=100"), schedules("trainer.steps=200"), steps_done=50)


def test_wsd_can_extend_its_horizon_while_still_stable():
    wsd = ["optimizer.schedule=wsd", "optimizer.warmup_steps=10", "optimizer.wsd_decay_fraction=0.2"]
    done = schedules("trainer.steps=100", *wsd)
    longer = schedules("trainer.steps=300", *wsd)
    check_extension(done, longer, steps_done=80)  # the decay (from step 81) had not started
    with pytest.raises(UserError, match="lr_mult at step 81"):
        check_extension(done, longer, steps_done=90)


def test_ramps_at_known_steps_and_off_by_default():
    off = schedules("trainer.steps=100")
    assert off.primary_weight is None and off.shared_gate is None and off.routed_gate is None
    assert off.diversity is None  # no hidden default ramp of anything
    s = schedules(
        "trainer.steps=100",
        "routing.primary_weight=0.5",
        "routing.primary_weight_final=0.9",
        "routing.primary_weight_ramp=0.4",
        "routing.primary_weight_ramp_shape=linear",
        "model.routed_gate_final=0.2",
        "model.gate_ramp=0.5",
        "loss.diversity_weight=0.01",
        "loss.diversity_ramp=0.1",
    )
    p = s.primary_weight
    assert [p(1), p(21), p(41), p(100)] == pytest.approx([0.5, 0.7, 0.9, 0.9])
    g = s.routed_gate  # cosine from routed_gate_init 1.0 over 50 steps
    assert [g(1), g(26), g(51)] == pytest.approx([1.0, 0.6, 0.2])
    assert s.shared_gate is None
    d = s.diversity
    assert [d(1), d(6), d(11), d(50)] == pytest.approx([0.0, 0.005, 0.01, 0.01])
    const = schedules("loss.diversity_weight=0.01").diversity
    assert const(1) == const(100) == 0.01  # no ramp: lambda from step 1


def test_primary_weight_change_changes_the_routed_output():
    cfg = to_config(compose_config("data=random", "model.vocab_size=64"))
    torch.manual_seed(0)
    routed = TRMoETransformer(model_spec(cfg)).blocks[0].ffn.routed
    x, ids = torch.randn(10, 64), torch.arange(10)
    a = routed(x, ids)
    routed.primary_weight = 0.9
    b = routed(x, ids)
    assert routed.primary_weight == 0.9 and routed.route_w.tolist() == pytest.approx([0.9, 0.1])
    assert not torch.allclose(a, b)


def test_scheduled_p_and_gates_drive_the_run_and_default_p_stays_put(tmp_path):
    train(compose_config(*FAST, "trainer.steps=5", "trainer.log_every=1"), tmp_path / "default")
    assert {r["primary_weight"] for r in rows(tmp_path / "default")} == {"0.5"}

    train(
        compose_config(
            *FAST,
            "trainer.steps=5",
            "trainer.log_every=1",
            "routing.primary_weight_final=0.9",
            "routing.primary_weight_ramp=0.8",
            "routing.primary_weight_ramp_shape=linear",
            "model.routed_gate_final=0.25",
            "model.gate_ramp=0.8",
            "model.gate_ramp_shape=linear",
        ),
        tmp_path / "ramped",
    )
    r = rows(tmp_path / "ramped")
    assert [float(x["primary_weight"]) for x in r] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    # the scheduled gate is written, not learned: exactly the ramp, though training moves the other gate
    assert [float(x["routed_gate"]) for x in r] == pytest.approx([1.0, 0.8125, 0.625, 0.4375, 0.25])
    assert float(r[-1]["shared_gate"]) != 1.0


def test_expert_diversity_penalty_values_and_effect(tmp_path):
    cfg = to_config(compose_config("data=random", "model.vocab_size=64"))
    torch.manual_seed(0)
    model = TRMoETransformer(model_spec(cfg))
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.routed.w_out.copy_(block.ffn.routed.w_out[:1].expand_as(block.ffn.routed.w_out))
    assert float(expert_diversity(model).detach()) == pytest.approx(1.0)  # identical experts
    with torch.no_grad():
        for block in model.blocks:
            w = block.ffn.routed.w_out
            w.zero_()
            for e in range(w.shape[0]):
                w[e, e, 0] = 1.0  # disjoint supports: orthogonal
    assert float(expert_diversity(model).detach()) == pytest.approx(0.0)

    # in training, a large lambda drives the penalty down faster than lambda = 0 does
    base = [*FAST, "trainer.steps=6", "trainer.log_every=6", "optimizer.lr=1e-3", "optimizer.warmup_steps=1"]
    finals = {}
    for lam in (1e-9, 100.0):
        name = f"lam{lam}"
        train(compose_config(*base, f"loss.diversity_weight={lam}"), tmp_path / name)
        last = rows(tmp_path / name)[-1]
        assert float(last["diversity_lambda"]) == pytest.approx(lam)
        finals[lam] = float(last["diversity"])
    assert finals[100.0] < 0.5 * finals[1e-9]


def test_diversity_target_all_also_compares_the_gate_and_up_halves():
    cfg = to_config(compose_config("data=random", "model.vocab_size=64"))
    torch.manual_seed(0)
    model = TRMoETransformer(model_spec(cfg))
    with torch.no_grad():  # identical up halves, orthogonal-ish everything else
        for block in model.blocks:
            w_in = block.ffn.routed.w_in
            half = w_in.shape[-1] // 2
            w_in[..., half:] = w_in[:1, :, half:]
    w_out_only = float(expert_diversity(model, DiversityTarget.w_out).detach())
    everything = float(expert_diversity(model, DiversityTarget.all).detach())
    assert w_out_only < 0.1 and everything > 0.3  # the identical up halves count only with target=all


def test_shared_gate_schedule():
    s = schedules("trainer.steps=10", "model.shared_gate_final=0.5", "model.gate_ramp=0", "model.gates=true")
    assert s.shared_gate(1) == 0.5 and s.routed_gate is None  # ramp 0: the final value from step 1


# ------------------------------------------------------------------ the old runner's schedules (compat)
# Its rules, written here from the fact sheet (4.8), not from its code: T = --steps, s the 1-based step.


def runner_lr(s: int, steps: int) -> float:
    """LambdaLR from 0, stepped after every optimizer step: step s runs at lambda(s - 1)."""
    warmup = max(1, int(0.05 * steps))
    x = s - 1
    if x < warmup:
        return x / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (x - warmup) / max(1, steps - warmup)))


def runner_ramp(s: int, steps: int, ratio: float, start: float, final: float) -> float:
    """p, the scheduled gates and lambda: a cosine over R = max(1, int(T * ratio)) steps; ratio <= 0 or
    R <= 1 is the final value from step 1."""
    ramp = max(1, int(steps * ratio))
    if ratio <= 0 or ramp <= 1:
        return final
    return start + (final - start) * (0.5 - 0.5 * math.cos(math.pi * min(1.0, (s - 1) / ramp)))


RUNNER_FLAGS = [  # a run with every schedule on: p 0.5 -> 0.9, both gates scheduled, lambda 0.02
    "routing.primary_weight_final=0.9",
    "model.gates=true",
    "model.shared_gate_final=0.6",
    "model.routed_gate_final=0.7",
    "loss.diversity_weight=0.02",
]


def _runner_values(s: int, steps: int) -> dict[str, float]:
    return {
        "lr_mult": runner_lr(s, steps),
        "primary_weight": runner_ramp(s, steps, 0.5, 0.5, 0.9),
        "shared_gate": runner_ramp(s, steps, 0.5, 1.0, 0.6),
        "routed_gate": runner_ramp(s, steps, 0.5, 0.1, 0.7),
        "diversity": runner_ramp(s, steps, 0.7, 0.0, 0.02),
    }


def _mismatches(cfg, steps: int) -> set[str]:
    s = build_schedules(replace(cfg, trainer=replace(cfg.trainer, steps=steps)))
    out = set()
    for step in range(1, steps + 1):
        want, got = _runner_values(step, steps), s.at(step)
        out |= {k for k in want if not math.isclose(got[k], want[k], rel_tol=1e-12, abs_tol=1e-15)}
    return out


@pytest.mark.parametrize("steps", [20, 23, 30])
def test_the_compat_preset_gives_the_old_runners_lr_and_ramps_at_every_step(steps):
    """compat=old_runner: LR, p, both gates and lambda equal the runner's rule at every step, at T = 20 and
    at T where round and int part (23: the p and gate ramps 12 vs 11 steps; 30: the warmup 2 vs 1)."""
    preset = to_config(
        compose_config("data=random", "compat=old_runner", f"trainer.steps={steps}", *RUNNER_FLAGS)
    )
    assert _mismatches(preset, steps) == set()
    s = build_schedules(preset)
    assert s.lr(1) == 0.0 and s.lr(steps) > 0.1  # step 1 at LR 0; the last at lambda(T - 1), not the floor
    # negative control: trmoe's own timing and rounding are not the runner's
    own = to_config(
        compose_config(
            "data=random",
            "compat=old_runner",
            f"trainer.steps={steps}",
            "optimizer.schedule_offset=0",
            "optimizer.schedule_rounding=round",
            *RUNNER_FLAGS,
        )
    )
    assert "lr_mult" in _mismatches(own, steps)
    if steps != 20:
        o = replace(preset.optimizer, schedule_rounding=ScheduleRounding.round)
        parted = {"lr_mult"} if steps == 30 else {"primary_weight", "shared_gate", "routed_gate"}
        assert _mismatches(replace(preset, optimizer=o), steps) == parted


def test_the_compat_preset_matches_the_runner_for_every_run_length_up_to_400():
    preset = to_config(compose_config("data=random", "compat=old_runner", *RUNNER_FLAGS))
    assert [t for t in range(1, 401) if _mismatches(preset, t)] == []


def test_a_run_under_the_compat_preset_logs_the_old_runners_lr_and_p(tmp_path):
    """The values reach the optimizer and the model: metrics.csv's lr and p at every step of a real run."""
    steps = 23
    train(
        compose_config(
            *FAST, "compat=old_runner", f"trainer.steps={steps}", "trainer.log_every=1", *RUNNER_FLAGS
        ),
        tmp_path / "run",
    )
    r = rows(tmp_path / "run")
    assert [int(x["step"]) for x in r] == list(range(1, steps + 1))
    want = [_runner_values(s, steps) for s in range(1, steps + 1)]
    assert [float(x["lr"]) for x in r] == pytest.approx([3e-4 * w["lr_mult"] for w in want], rel=1e-6)
    assert [float(x["primary_weight"]) for x in r] == pytest.approx([w["primary_weight"] for w in want])
    assert [float(x["routed_gate"]) for x in r] == pytest.approx([w["routed_gate"] for w in want])
    assert float(r[0]["lr"]) == 0.0


def test_the_pages_overrides_for_the_runners_open_ended_run():
    """--steps 0: LR warmup of 100 steps, then constant; p, gates and lambda at their final values from step 1
    (the runner's schedules take T = 1). The page's row, with the preset, gives the same at every step."""
    row = ["optimizer.schedule=constant", "optimizer.warmup_steps=100", "routing.primary_weight_ramp=0"]
    row += ["model.gate_ramp=0", "loss.diversity_ramp=0"]
    cfg = compose_config("data=random", "compat=old_runner", "trainer.steps=300", *row, *RUNNER_FLAGS)
    s = build_schedules(to_config(cfg))
    for step in range(1, 301):
        want = _runner_values(step, 1) | {"lr_mult": min(1.0, (step - 1) / 100)}
        assert s.at(step) == pytest.approx(want), step


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("optimizer.schedule_offset=-1", "optimizer.schedule_offset"),
        ("optimizer.schedule_rounding=ceil", "ceil"),
    ],
)
def test_a_bad_schedule_offset_or_rounding_is_one_line(tmp_path, override, named):
    from helpers import cli

    out = cli([*FAST, "trainer.steps=2", override], tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and named in lines[0], out.stderr
    assert not (tmp_path / "runs").exists()
