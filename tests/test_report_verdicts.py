"""The report's Verdicts (trmoe.report.verdicts) on fabricated sweeps: run directories written as trmoe.train
writes them (run_config.json with params, model_spec, backend and config; metrics.csv with tokens, eval_loss,
tok_s and elapsed_s; status.json; .hydra/overrides.yaml; the sweep's multirun.yaml naming the control), with
planted differences, equivalences, compute multipliers and throughputs. No training."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers import cli

from trmoe.report.build import REPORT_MD, VERDICTS_CSV, build_report
from trmoe.report.verdicts import Options, holm

STEPS, EVAL_EVERY, TOKENS_PER_STEP = 40, 4, 1000
SPEC = {"num_layers": 2, "num_heads": 2, "head_dim": 16, "hidden_size": 32, "embedding_rows": 256}
PARAMS = {"total": 100_000, "active": 100_000, "embedding": 8192, "non_embedding": 91_808}


def control_curve(tokens: float) -> float:
    """The control's held-out loss against tokens (falling, as a trained model's)."""
    return 2.0 + 4.0 / math.sqrt(tokens / TOKENS_PER_STEP)


def write_run(
    path: Path,
    *,
    arm: str,
    seed: int,
    loss,
    tok_s: float,
    rng: np.random.Generator,
    threads: int = 1,
    seconds_per_step: float | None = None,
) -> None:
    """One finished run: `loss(tokens)` at each evaluation (every EVAL_EVERY steps), `tok_s` per logging
    window with 2% noise, elapsed_s = training seconds (tokens / tok_s, or `seconds_per_step`)."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(f"- routing={arm}\n- trainer.seed={seed}\n")
    config = {
        "trainer": {"steps": STEPS, "seed": seed, "seq_len": 64, "compile": False},
        "hardware": {"threads": threads, "precision": "fp32"},
        "routing": {"strategy": "modulo_cyclic"},
    }
    backend = {"device": "cpu", "device_name": "fabricated cpu", "threads": threads, "autocast_dtype": None}
    record = {"schema_version": 1, "config": config, "params": PARAMS, "model_spec": SPEC}
    record.update(backend=backend, world_size=1, total_tokens=STEPS * TOKENS_PER_STEP)
    record["derived"] = {"eval_windows": 8}
    (path / "run_config.json").write_text(json.dumps(record))
    lines, elapsed = ["step,tokens,train_loss,eval_loss,tok_s,elapsed_s"], 0.0
    for step in range(1, STEPS + 1):
        tokens = step * TOKENS_PER_STEP
        speed = tok_s * math.exp(rng.normal(0, 0.02))
        elapsed += seconds_per_step if seconds_per_step else TOKENS_PER_STEP / speed
        ev = repr(float(loss(tokens))) if step % EVAL_EVERY == 0 else "nan"
        lines.append(f"{step},{tokens},{loss(tokens) + 0.1!r},{ev},{speed!r},{elapsed!r}")
    (path / "metrics.csv").write_text("\n".join(lines) + "\n")
    final = float(loss(STEPS * TOKENS_PER_STEP))
    (path / "status.json").write_text(json.dumps({"status": "finished", "final_eval_loss": final}))


def sweep_dir(root: Path, arms: list[str], seeds: int) -> Path:
    root.mkdir(parents=True)
    hydra = {
        "callbacks": {"report": {"control": "routing=control"}},
        "sweeper": {"params": {"routing": ",".join(arms), "trainer.seed": ",".join(map(str, range(seeds)))}},
    }
    (root / "multirun.yaml").write_text(json.dumps({"hydra": hydra}))
    return root


def _verdict(rep, arm: str) -> str:
    return next(v.verdict for v in rep.verdicts.loss if v.pair.arm.label == f"routing={arm}")


def _planted(root: Path, case: int) -> Path:
    """Control, an arm 0.05 nats worse (the margin 0.01: a real difference) and an arm equal to the
    control, 4 seeds each; the seed moves all arms alike, the arm's own noise is small."""
    rng = np.random.default_rng(case)
    sweep = sweep_dir(root / f"case{case}", ["control", "worse", "same"], 4)
    job = 0
    for seed in range(4):
        shift = rng.normal(0, 0.02)  # what a seed does to every arm (init, data order)
        for arm, delta, noise in (("control", 0, 0), ("worse", 0.05, 0.005), ("same", 0, 0.002)):
            offset = shift + delta + rng.normal(0, noise) if noise else shift

            def loss(tokens, offset=offset):
                return control_curve(tokens) + offset

            write_run(sweep / str(job), arm=arm, seed=seed, loss=loss, tok_s=1000, rng=rng)
            job += 1
    return sweep


def test_tost_verdicts_are_right_in_95_percent_of_seeded_cases(tmp_path):
    cases, right = 40, {"worse": 0, "same": 0}
    for case in range(cases):
        rep = build_report([_planted(tmp_path, case)], make_plots=False)
        right["worse"] += _verdict(rep, "worse") == "worse"
        right["same"] += _verdict(rep, "same") == "equivalent within δ=0.01"
    assert right["worse"] >= 0.95 * cases and right["same"] >= 0.95 * cases, right
    md = (tmp_path / f"case{cases - 1}" / REPORT_MD).read_text()
    assert "## Verdicts" in md and "Holm-corrected over the arms" in md and "δ = 0.01 nats/token" in md


def test_a_wider_margin_is_honoured_and_one_seed_is_inconclusive(tmp_path):
    sweep = _planted(tmp_path, 0)
    rep = build_report([sweep], make_plots=False, verdicts=Options(margin=0.2))
    assert _verdict(rep, "worse") == "equivalent within δ=0.2"  # 0.05 worse is within a 0.2 margin
    one = sweep_dir(tmp_path / "one", ["control", "same"], 1)
    rng = np.random.default_rng(0)
    for job, arm in enumerate(("control", "same")):
        write_run(one / str(job), arm=arm, seed=0, loss=control_curve, tok_s=1000, rng=rng)
    rep = build_report([one], make_plots=False)
    assert _verdict(rep, "same").startswith("inconclusive (fewer than 2 paired seeds")


def test_holm_adjusts_step_down():
    assert holm([0.01, 0.04, None, 0.03]) == pytest.approx([0.03, 0.06, None, 0.06])


def _speed_sweep(root: Path, *, arm_threads: int = 1) -> Path:
    """A control and an arm with half the control's compute efficiency (its loss at D is the control's at
    D/2: k = 0.5) at 1.5x the control's tokens per second, 3 seeds."""
    rng = np.random.default_rng(1)
    sweep = sweep_dir(root, ["control", "arm"], 3)
    for seed in range(3):
        write_run(sweep / f"c{seed}", arm="control", seed=seed, loss=control_curve, tok_s=1000, rng=rng)
        write_run(sweep / f"a{seed}", arm="arm", seed=seed, loss=lambda d: control_curve(d / 2), tok_s=1500,
                  rng=rng, threads=arm_threads)  # fmt: skip
    return sweep


def test_the_effective_speed_up_is_the_product_of_its_parts(tmp_path):
    sweep = _speed_sweep(tmp_path / "s")
    rep = build_report([sweep], make_plots=False)
    (sp,) = rep.verdicts.speedups
    assert sp.seeds == [0, 1, 2] and sp.k_source == "matched-FLOP loss curves"
    assert sp.k[0] == pytest.approx(0.5, rel=1e-9)  # planted exactly, an evaluation of the control there
    assert sp.rho[0] == pytest.approx(1.5, rel=0.02) and sp.rho[1] < sp.rho[0] < sp.rho[2]
    assert sp.effective[0] == pytest.approx(sp.k[0] * sp.rho[0], rel=1e-12)
    for seed, k, rho in sp.per_seed:
        assert k == pytest.approx(0.5) and rho == pytest.approx(1.5, rel=0.02), seed
    with open(sweep / VERDICTS_CSV, newline="") as f:
        rows = {r["measure"]: r for r in csv.DictReader(f) if r["arm"] == "routing=arm"}
    parts = float(rows["compute_multiplier"]["value"]) * float(rows["throughput_ratio"]["value"])
    assert float(rows["effective_speedup"]["value"]) == pytest.approx(parts, rel=1e-12)
    md = (sweep / REPORT_MD).read_text()
    assert "### Effective speed-up" in md and "0.500×" in md


def test_an_arm_below_the_controls_lowest_loss_is_measured_there_with_its_planted_k(tmp_path):
    """An arm twice as compute-efficient (its loss at D is the control's at 2D: k = 2) ends below anything the
    control reached; k is measured at the control's lowest loss, which the arm reaches at half the tokens (an
    evaluation step of both: exact), and the report says so per seed. Several noise seeds of the throughput:
    k never moves, only rho does."""
    for case in range(5):
        rng = np.random.default_rng(case)
        sweep = sweep_dir(tmp_path / f"b{case}", ["control", "arm"], 2)
        for seed in range(2):
            write_run(sweep / f"c{seed}", arm="control", seed=seed, loss=control_curve, tok_s=1000, rng=rng)
            write_run(sweep / f"a{seed}", arm="arm", seed=seed, loss=lambda d: control_curve(2 * d),
                      tok_s=1000, rng=rng)  # fmt: skip
        (sp,) = build_report([sweep], make_plots=False).verdicts.speedups
        assert [k for _, k, _ in sp.per_seed] == [pytest.approx(2.0, rel=1e-9)] * 2, sp.per_seed
        assert sp.k[0] == pytest.approx(2.0, rel=1e-9)
        assert sp.effective[0] == pytest.approx(sp.k[0] * sp.rho[0], rel=1e-12)
        assert "seed 0: k at the control's lowest loss (the arm's final is below it)" in sp.notes


def test_the_throughput_ratio_is_refused_across_thread_counts(tmp_path):
    sweep = _speed_sweep(tmp_path / "t", arm_threads=2)
    rep = build_report([sweep], make_plots=False)
    (sp,) = rep.verdicts.speedups
    assert sp.rho is None and sp.effective is None and sp.k[0] == pytest.approx(0.5)
    assert all(r.startswith("refused: hardware.threads 2 vs 1") for _, _, r in sp.per_seed)
    section = (sweep / REPORT_MD).read_text().split("### Effective speed-up", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| routing=arm | 3 |"))
    assert "throughput ratio refused: hardware.threads 2 vs 1" in row and "torch threads 2 vs 1" in row


def test_time_to_target_is_interpolated_or_not_reached(tmp_path):
    sweep = sweep_dir(tmp_path / "w", ["control", "slow", "never"], 1)
    rng = np.random.default_rng(0)
    write_run(sweep / "0", arm="control", seed=0, loss=control_curve, tok_s=1000, rng=rng, seconds_per_step=1)
    write_run(sweep / "1", arm="slow", seed=0, loss=control_curve, tok_s=1000, rng=rng, seconds_per_step=2)
    write_run(sweep / "2", arm="never", seed=0, loss=lambda d: control_curve(d) + 1, tok_s=1000, rng=rng)
    target = (control_curve(14_000) + control_curve(18_000)) / 2  # between evaluations at steps 16 and 20
    rep = build_report([sweep], verdicts=Options(target_loss=target))
    md = (sweep / REPORT_MD).read_text()
    section = md.split("### Time to the target held-out loss", 1)[1]
    l16, l20 = control_curve(16_000), control_curve(20_000)
    expected = 16 + 4 * (l16 - target) / (l16 - l20) if target < l16 else None
    expected = expected or 12 + 4 * (control_curve(12_000) - target) / (control_curve(12_000) - l16)
    assert f"| routing=control | 1 | {expected:.1f} s |" in section
    assert f"| routing=slow | 1 | {2 * expected:.1f} s |" in section
    assert "| routing=never | 1 | not reached (1 of 1 seeds) |" in section
    assert (sweep / "plots" / "loss_vs_wallclock.png").is_file() and rep.plots


@pytest.mark.parametrize("option", ["--margin", "--target-loss", "--accuracy-margin"])
def test_a_bad_margin_or_target_is_one_line_and_writes_nothing(tmp_path, option):
    sweep = _planted(tmp_path, 0)
    before = sorted(p.name for p in sweep.iterdir())
    result = cli([str(sweep), option, "-0.5", "--no-plots"], cwd=tmp_path, module="trmoe.report")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"trmoe: report: {option} -0.5: allowed: a positive number\n"
    assert sorted(p.name for p in sweep.iterdir()) == before
