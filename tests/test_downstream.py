"""Downstream accuracy during training (`downstream.tasks`, observe/downstream.py): the harness's acc and
acc_norm on the local task as metrics.csv columns, equal to `python -m trmoe.eval` on the same checkpoint;
training unchanged by it; kill -9 and resume keeps the columns bit-identical; a 2-arm x 2-seed sweep's
report tables the accuracies with paired intervals; bad input is one line and exit 2, nothing written."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from helpers import TIMING_COLUMNS, assert_same_run, cli, compose_config, drive, metrics_rows
from presets import O200K_NARROW, TRAINING_SENTENCES

pytest.importorskip("lm_eval")  # the `eval` extra (make test installs it)

from trmoe.run.checkpoint import load_checkpoint  # noqa: E402
from trmoe.train.loop import train  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
TASK = "trmoe_tiny_mc"
COLUMNS = (f"acc/{TASK}", f"acc_norm/{TASK}")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    docs = [" ".join(TRAINING_SENTENCES)] * 20 + ["Held out text about something else entirely."] * 3
    path.write_text("\n\n".join(f"{d} ({i})" for i, d in enumerate(docs)) + "\n")
    return path


def run_args(corpus: Path, *extra: str) -> list[str]:
    return [
        "model=tiny",
        *O200K_NARROW,
        "data=text",
        f"data.text_path={corpus}",
        "data.eval_fraction=0.2",
        "hardware=cpu",
        "hardware.threads=1",
        "run.progress=log",
        "run.name=d",
        "trainer.seq_len=32",
        "trainer.micro_batch=4",
        "trainer.steps=8",
        "trainer.eval_every=6",
        "trainer.eval_batches=1",
        "trainer.log_every=4",
        "optimizer.lr=1e-2",
        "optimizer.warmup_steps=2",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=0",
        *extra,
    ]


DOWNSTREAM = [f"downstream.tasks=[{TASK}]", f"downstream.include_path={TASKS}", "downstream.limit=6"]


def _train(args: list[str], run_dir: Path) -> None:
    threads = torch.get_num_threads()
    try:
        train(compose_config(*args), run_dir)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def with_tasks(corpus, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("with") / "d"
    _train(run_args(corpus, *DOWNSTREAM, "downstream.every=4"), run_dir)
    return run_dir


def test_columns_are_written_and_equal_python_m_trmoe_eval(with_tasks, corpus, tmp_path):
    rows = metrics_rows(with_tasks)
    scored = [r for r in rows if r[COLUMNS[0]] != "nan"]
    assert [r["step"] for r in scored] == ["0", "4", "8"]  # downstream.every=4, and steps 0 and last
    assert all(r[COLUMNS[1]] != "nan" for r in scored)
    assert all(r[c] == "nan" for r in rows if r not in scored for c in COLUMNS)
    record = json.loads((with_tasks / "run_config.json").read_text())
    assert record["metrics_columns"][-2:] == list(COLUMNS)
    for step in (4, 8):
        out = tmp_path / f"{step}.json"
        args = [f"run={with_tasks}", f"step={step}", f"tasks=[{TASK}]", f"include_path={TASKS}"]
        result = cli([*args, "limit=6", f"out={out}"], cwd=tmp_path, module="trmoe.eval")
        assert result.returncode == 0, result.stderr[-3000:]
        figures = json.loads(out.read_text())["results"][TASK]
        row = next(r for r in rows if r["step"] == str(step))
        # metrics.csv writes 9 significant digits (trmoe.run.records)
        assert row[COLUMNS[0]] == f"{figures['acc,none']:.9g}"
        assert row[COLUMNS[1]] == f"{figures['acc_norm,none']:.9g}"
    # the tiny model learns the sentences the questions are about (6 examples: chance is ~1/3)
    assert float(scored[-1][COLUMNS[0]]) > float(scored[0][COLUMNS[0]])


def test_evaluation_does_not_change_training(with_tasks, corpus, tmp_path):
    """The same run without the option: every other column and the final weights are identical."""
    run_dir = tmp_path / "d"
    _train(run_args(corpus), run_dir)
    plain, rows = metrics_rows(run_dir), metrics_rows(with_tasks)
    by_step = {r["step"]: r for r in rows}
    assert {r["step"] for r in plain} <= set(by_step)
    for row in plain:
        for column, value in row.items():
            if column not in TIMING_COLUMNS:
                assert by_step[row["step"]][column] == value, (row["step"], column)
    a, b = load_checkpoint(run_dir), load_checkpoint(with_tasks)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


@pytest.mark.subprocess
def test_kill_9_then_resume_keeps_the_columns_bit_identical(with_tasks, corpus, tmp_path):
    args = run_args(corpus, *DOWNSTREAM, "downstream.every=4")
    killed = drive("step:6:forward", tmp_path, *args, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "d"
    _train(args, run_dir)
    assert "resumed at step 4" in (run_dir / "train.log").read_text()
    assert_same_run(run_dir, with_tasks)  # every column but the timings, the downstream ones included


@pytest.mark.parametrize(
    "extra, message",
    [
        (["downstream.tasks=[no_such_task_xyz]", f"downstream.include_path={TASKS}"], "unknown task"),
        # include_path as the case above: the harness's own index (~10 s) is built once for both
        (
            ["downstream.tasks=[arc_easy]", f"downstream.include_path={TASKS}"],
            "arc_easy: its data is not available offline",
        ),
        ([f"downstream.tasks=[{TASK}]", "downstream.include_path=/no/such/dir"], "downstream.include_path"),
        ([*DOWNSTREAM, "downstream.limit=0"], "downstream.limit=0"),
        ([*DOWNSTREAM, "downstream.every=-1"], "downstream.every=-1"),
        ([*DOWNSTREAM, "data=random", "data.text_path=null", "model.vocab_size=512"], "downstream.tasks"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(corpus, tmp_path, extra, message):
    out = cli(run_args(corpus, *extra), tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def test_a_sweep_report_tables_the_accuracies_with_paired_intervals(corpus, tmp_path):
    """2 arms x 2 seeds through the real --multirun; the report the sweep writes at its end."""
    sweep = tmp_path / "sweep"
    args = [a for a in run_args(corpus, *DOWNSTREAM) if not a.startswith(("run.name", "checkpoint."))]
    args = [a for a in args if not a.startswith(("trainer.steps", "trainer.eval_every"))]
    out = cli(
        [
            "--multirun",
            "routing=modulo_cyclic,multi_hash",
            "trainer.seed=1,2",
            *args,
            "trainer.steps=2",
            "trainer.eval_every=0",
            "checkpoint.enabled=false",  # the report reads the records only
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = (sweep / "report.md").read_text()
    assert "## Downstream accuracy" in text and "Higher is better" in text
    finals: dict[str, list[float]] = {}
    for job in sorted(p for p in sweep.iterdir() if (p / "metrics.csv").is_file()):
        record = json.loads((job / "run_config.json").read_text())
        arm = record["config"]["routing"]["strategy"]
        finals.setdefault(arm, []).append(float(metrics_rows(job)[-1][COLUMNS[0]]))
    assert sorted(finals) == ["modulo_cyclic", "multi_hash"] and all(len(v) == 2 for v in finals.values())
    for arm, values in finals.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {TASK} | acc | routing={arm} |"))
        assert f"| 2 | {sum(values) / 2:.4f} |" in line, line
        if arm == "multi_hash":  # against the control, seed by seed: 2 seeds give an interval
            assert "[" in line and "]" in line, line
    header = (sweep / "report.csv").read_text().splitlines()[0].split(",")
    assert set(COLUMNS) <= set(header)
    assert (sweep / "plots" / "accuracy_vs_tokens.png").is_file()


def test_columns_leave_every_global_generator_and_train_mode_as_they_were(with_tasks, corpus):
    """The harness reseeds Python's, numpy's and torch's generators: the component restores them."""
    import random

    import numpy as np

    from trmoe.config.resolve import to_config
    from trmoe.load import load_model
    from trmoe.train.observe.downstream import Downstream

    component = Downstream(to_config(compose_config(*run_args(corpus, *DOWNSTREAM))))
    model = load_model(with_tasks).model.train()
    component.attach(model, torch.device("cpu"), None)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert component.names == COLUMNS and set(component.columns(8)) == set(COLUMNS)
    assert model.training
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
