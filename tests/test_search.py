"""hparams_search=<preset>: Hydra's Optuna sweeper runs trials of the real train app, which returns the final
held-out loss; the sweep's report ranks the trials best first with the study's parameters as columns."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from helpers import cli
from presets import TINY_RUN

SEARCH = [
    "hparams_search=lr_warmup",
    "hydra.sweeper.n_trials=3",
    # a key set on the command line is not searched
    *[o for o in TINY_RUN if not o.startswith("optimizer.")],
    "hardware=cpu",
    "hardware.threads=1",
    "trainer.steps=4",
]


def test_optuna_search_minimises_the_returned_loss_and_reports_trials(tmp_path):
    out = cli(SEARCH, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    finals = {
        d.name: json.loads((d / "status.json").read_text())["final_eval_loss"]
        for d in sweep.iterdir()
        if (d / "status.json").is_file()
    }
    assert sorted(finals) == ["0", "1", "2"]
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == min(finals.values())  # what the app returned is what Optuna minimised
    assert set(results["best_params"]) == {"optimizer.lr", "optimizer.warmup_steps"}

    report = (sweep / "report.md").read_text()
    assert "3 trials (3 finished) of the Optuna study `lr_warmup`" in report
    assert "separate runs" not in report and "## Warnings\n\nNone" in report
    trials = report.split("## Trials")[1].split("## Runs")[0]
    assert "| rank | trial | status | final eval | `optimizer.lr` | `optimizer.warmup_steps` |" in trials
    ranked = [m.group(1) for m in re.finditer(r"^\| \d \| (\d) \| finished \|", trials, re.M)]
    assert ranked == sorted(finals, key=finals.get)  # best first
    best = ranked[0]
    lr = yaml.safe_load((sweep / best / ".hydra" / "overrides.yaml").read_text())
    assert f"optimizer.lr={results['best_params']['optimizer.lr']}" in lr


DIVERGE = """# @package _global_
defaults:
  - override /hydra/sweeper: optuna
hydra:
  mode: MULTIRUN
  sweeper:
    direction: minimize
    study_name: diverge
    storage: null
    n_trials: 3
    n_jobs: 1
    max_failure_rate: 1.0
    sampler:
      _target_: optuna.samplers.TPESampler
      seed: 42
    params:
      optimizer.lr: choice(1.0e-3, 1.0e+8)
"""


@pytest.mark.parametrize(
    ("skip_nonfinite", "why"),
    [
        ("true", "RunFailed: stopped at step 2"),  # the guard stops the trial
        ("false", "the objective (final held-out loss) is not finite"),  # the trial returns NaN
    ],
)
def test_a_diverged_or_stopped_trial_is_failed_and_the_study_goes_on(tmp_path, skip_nonfinite, why):
    """A trial at lr 1e8 (the TPE's first draw with seed 42) diverges: Optuna is told it failed, the other
    trials run, the study's results and the report are written, and the report lists the failed trial."""
    conf = tmp_path / "conf" / "hparams_search"
    conf.mkdir(parents=True)
    (conf / "diverge.yaml").write_text(DIVERGE)
    base = [o for o in SEARCH if not o.startswith(("hparams_search=", "hydra.sweeper.n_trials="))]
    args = ["--config-dir", str(tmp_path / "conf"), "hparams_search=diverge", *base]
    out = cli([*args, f"guard.skip_nonfinite={skip_nonfinite}", "guard.max_skips=1"], tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"sweep job 0 failed: {why}" in out.stderr
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    assert sorted(d.name for d in sweep.iterdir() if d.is_dir() and d.name.isdigit()) == ["0", "1", "2"]
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"optimizer.lr": 0.001}
    report = (sweep / "report.md").read_text()
    trials = report.split("## Trials")[1].split("## Runs")[0]
    row = next(line for line in trials.splitlines() if line.startswith("| 3 | 0 |"))
    assert "failed" in row or "diverged" in row, row


def test_a_search_in_which_every_trial_fails_writes_its_report_and_one_line(tmp_path):
    """Every trial diverges: the sweeper's own `study.best_trial` has no trial to give ("No trials are
    completed yet", a traceback, no report). trmoe answers with the sweep's report (each trial failed) and
    one line naming the trials, exit 1 as any sweep with a failed job."""
    args = [*SEARCH[:1], "hydra.sweeper.n_trials=2", *SEARCH[2:]]
    out = cli([*args, "optimizer.lr=interval(1e29,1e30)", "guard.skip_nonfinite=false"], tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "No trials are completed" not in out.stderr
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("trmoe: every trial of the search failed (trials 0, 1:"), last
    assert str(sweep) in last
    trials = (sweep / "report.md").read_text().split("## Trials")[1].split("## Runs")[0]
    rows = [line for line in trials.splitlines() if re.match(r"^\| \d \| \d \|", line)]
    assert len(rows) == 2 and all("failed" in row or "diverged" in row for row in rows), trials
