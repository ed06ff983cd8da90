"""hparams_search=<preset>: Hydra's Optuna sweeper runs trials of the real train app, which returns the final
held-out loss; the sweep's report ranks the trials best first with the study's parameters as columns."""

from __future__ import annotations

import json
import re

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
