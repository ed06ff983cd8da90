"""The report's figures come from a complete row of the final step or are unknown with the reason
(trmoe.report.runs, integrity, checks), and its plots of per-step columns from the run's declarations
(run_config.json's metrics_declared): fabricated run directories, no training."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import cli

from trmoe.report.runs import load_runs
from trmoe.report.summary import summarize

HEADER = "step,tokens,train_loss,eval_loss,eval_bpb"


def _run(path: Path, lines: list[str], *, seed: int = 0, record: bool = True, end: str = "\n") -> Path:
    """A finished 4-step run: run_config.json (unless `record` is False), status.json, metrics.csv of
    `lines` (the last one ending with `end`)."""
    path.mkdir(parents=True)
    if record:
        config = {"trainer": {"steps": 4, "seed": seed}, "model": {"vocab_size": 256}}
        (path / "run_config.json").write_text(json.dumps({"schema_version": 1, "config": config}))
    (path / "status.json").write_text(json.dumps({"status": "finished", "final_eval_loss": 3.4}))
    (path / "metrics.csv").write_text("\n".join([HEADER, *lines]) + end)
    return path


ROWS = ["1,1024,5.0,nan,nan", "2,2048,4.5,4.0,4.1", "3,3072,4.0,nan,nan", "4,4096,3.6,3.4,3.5373"]


def test_a_truncated_last_row_gives_no_figure(tmp_path):
    """The kill cut the last line inside its eval_bpb (old code: eval_bpb 3.5 taken for 3.5373)."""
    run_dir = _run(tmp_path / "r", [*ROWS[:3], "4,4096,3.6,3.4,3.5"], end="")
    run = load_runs([run_dir])[0]
    s = summarize(run)
    assert s.eval_bpb is None and s.tokens is None and s.train_loss is None
    assert s.final_eval == 3.4  # status.json's figure of the final step, which it recorded
    assert any("last line is cut short" in note for note in run.unreadable)
    assert any("ends at step 3" in d for d in s.disagreements)


def test_rows_out_of_order_give_the_final_steps_figures(tmp_path):
    """Old code: `tokens` from the physically last row (step 3's 3072)."""
    run_dir = _run(tmp_path / "r", [ROWS[0], ROWS[1], ROWS[3], ROWS[2]])
    run = load_runs([run_dir])[0]
    s = summarize(run)
    assert s.tokens == 4096 and s.eval_bpb == 3.5373 and s.train_loss == 3.6
    assert any("out of step order" in note for note in run.unreadable)


def test_two_rows_of_the_final_step_that_disagree_give_no_figure(tmp_path):
    run_dir = _run(tmp_path / "r", [*ROWS, "4,4096,3.6,3.4,3.9"])
    s = summarize(load_runs([run_dir])[0])
    assert s.eval_bpb is None and s.tokens == 4096
    assert any("2 rows for the final step 4" in d for d in s.disagreements)


def test_a_run_without_run_config_never_counts_as_matching(tmp_path):
    """Old code: "the runs match on every item" although one run's config was unknown."""
    runs = tmp_path / "runs"
    _run(runs / "a", ROWS)
    _run(runs / "b", ROWS, record=False)
    result = cli([str(runs), "--no-plots", "--quiet"], cwd=tmp_path, module="trmoe.report")
    assert result.returncode == 0, result.stderr
    md = (runs / "report.md").read_text()
    assert "match on every item" not in md
    assert "without a readable run_config.json" in md and "**UNKNOWN**" in md
    checklist = md.split("## Comparability checklist", 1)[1]
    assert "| same |" not in checklist.split("## ", 1)[0]


def test_runs_on_different_held_out_sets_are_not_paired(tmp_path):
    """The control evaluated on 8 windows, the arm on 4 (another trainer.micro_batch): no paired difference
    (old code: the two losses were subtracted as if measured on one set)."""
    from trmoe.report.compare import Arm, paired

    runs = tmp_path / "runs"
    for name, windows in (("control", 8), ("arm", 4)):
        _run(runs / name, ROWS)
        record = json.loads((runs / name / "run_config.json").read_text())
        (runs / name / "run_config.json").write_text(
            json.dumps({**record, "derived": {"eval_windows": windows}})
        )
    loaded = {r.name: r for r in load_runs([runs])}
    summaries = {name: summarize(run) for name, run in loaded.items()}
    control, arm = Arm("control", {}, [loaded["control"]]), Arm("arm", {}, [loaded["arm"]])
    (pair,) = paired([control, arm], control, summaries)
    assert pair.n == 0
    assert any("held-out set of 4 windows, the control's 8" in e for e in pair.excluded)


def _drawn_pixels(png: Path) -> int:
    """Pixels of the first arm's colour (tab10's first) in a figure: 0 on a blank axis."""
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(png)[..., :3]
    return int((np.abs(pixels - np.array([0.122, 0.467, 0.706])).max(axis=-1) < 0.05).sum())


def test_a_column_declared_plotted_gets_its_figure_with_no_report_change(tmp_path):
    """A producer that declares a new per-step column with plot=True: its run's report draws it against
    tokens (a PNG with data, inline in report.md); a run written before the declarations were recorded
    (metrics_columns only) plots what the report plotted then."""
    from trmoe.report.build import build_report
    from trmoe.run.columns import MetricColumn

    mine = MetricColumn("my_metric", "widgets", "train/my_metric", "widgets per step", plot=True)
    rows = [f"{row},{0.5 * i}" for i, row in enumerate(ROWS)]
    declared = [{"name": c} for c in HEADER.split(",")] + [mine.record()]
    for name, record in (("new", {"metrics_declared": declared}), ("old", {})):
        run_dir = _run(tmp_path / name / "r", rows)
        (run_dir / "metrics.csv").write_text("\n".join([f"{HEADER},my_metric", *rows]) + "\n")
        config = json.loads((run_dir / "run_config.json").read_text())
        (run_dir / "run_config.json").write_text(json.dumps({**config, **record}))

    rep = build_report([tmp_path / "new"], tmp_path / "new-report")
    png = tmp_path / "new-report" / "plots" / "metric_my_metric.png"
    assert png in rep.plots and "![metric_my_metric](plots/metric_my_metric.png)" in rep.markdown
    assert _drawn_pixels(png) > 50  # the line, not a blank axis
    assert load_runs([tmp_path / "new"])[0].declaration("my_metric").unit == "widgets"

    old = build_report([tmp_path / "old"], tmp_path / "old-report")
    assert not any("my_metric" in p.name for p in old.plots)
    assert load_runs([tmp_path / "old"])[0].declaration("eval_loss").unit == "nats/token"


def test_an_unreadable_declaration_record_is_a_note(tmp_path):
    run_dir = _run(tmp_path / "r", ROWS)
    config = json.loads((run_dir / "run_config.json").read_text())
    (run_dir / "run_config.json").write_text(json.dumps({**config, "metrics_declared": ["tok_s"]}))
    run = load_runs([run_dir])[0]
    assert any("`metrics_declared` is not a list of declarations" in n for n in run.unreadable)
    assert run.declaration("tok_s").unit == "tokens/s"  # as the code before the declarations wrote it


def _record(run_dir: Path, **fields) -> None:
    """Merge `fields` into the run's run_config.json (one level deep: dicts merged)."""
    path = run_dir / "run_config.json"
    record = json.loads(path.read_text())
    for key, value in fields.items():
        record[key] = {**record.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(record))


def _checklist(md: str) -> str:
    return md.split("## Comparability checklist", 1)[1].split("\n## ", 1)[0]


def _report_md(runs: Path, tmp_path: Path) -> str:
    result = cli([str(runs), "--no-plots", "--quiet"], cwd=tmp_path, module="trmoe.report")
    assert result.returncode == 0, result.stderr
    return (runs / "report.md").read_text()


def test_another_split_of_the_same_tokens_per_step_is_no_budget_difference(tmp_path):
    """micro_batch 1 x grad_accum 2 vs 2 x 1, same tokens per step and total (old code: "Token budget
    DIFFERS: micro_batch 1 vs 2, grad_accum 2 vs 1"); another tokens per step still differs."""
    runs = tmp_path / "runs"
    for name, micro, accum in (("a", 1, 2), ("b", 2, 1)):
        _run(runs / name, ROWS)
        _record(
            runs / name,
            config={"trainer": {"steps": 4, "seed": 0, "micro_batch": micro, "grad_accum": accum}},
            total_tokens=4096,
            tokens_per_step=1024,
            derived={"eval_windows": 8},
        )
    checklist = _checklist(_report_md(runs, tmp_path))
    budget = next(line for line in checklist.splitlines() if line.startswith("| Token budget"))
    assert "| same |" in budget and "split otherwise" in budget and "micro_batch" in budget
    _record(runs / "b", tokens_per_step=2048, total_tokens=8192)
    md = _report_md(runs, tmp_path)
    assert "Token budget differs" in md.split("## Comparability checklist", 1)[0]


def test_a_recorded_but_unknown_eval_bpb_is_not_estimated(tmp_path):
    """eval_bpb recorded as NaN (ids that are not text): no estimate footnoted "the run did not record
    eval_bpb" (old code); a run without the column is estimated, and says so."""
    rows = [r.rsplit(",", 1)[0] + ",nan" for r in ROWS]
    run_dir = _run(tmp_path / "r", rows)
    _record(run_dir, data={"eval": {"tokens": 1000, "bytes": 4000}})
    s = summarize(load_runs([run_dir])[0])
    assert s.eval_bpb is None and not s.bpb_estimated
    bare = _run(tmp_path / "bare", [r.rsplit(",", 1)[0] for r in ROWS])
    (bare / "metrics.csv").write_text(
        "\n".join(["step,tokens,train_loss,eval_loss", *[r.rsplit(",", 1)[0] for r in ROWS]]) + "\n"
    )
    _record(bare, data={"eval": {"tokens": 1000, "bytes": 4000}})
    s = summarize(load_runs([bare])[0])
    assert s.bpb_estimated and s.eval_bpb is not None


def test_a_resume_without_metrics_csv_is_a_warning_and_a_changed_held_out_set_no_same_row(tmp_path):
    """Old code: "Warnings: None" after a resume that lost metrics.csv's earlier rows, and the checklist row
    "steps ..., N tokens scored each" marked same after the report warned the held-out set changed."""
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        _run(runs / name, ROWS)
    _record(runs / "a", resumes=[{"from_step": 2, "metrics_rows": [0, 2], "volatile_changes": {}}])
    (runs / "a" / "metrics.csv").write_text("\n".join([HEADER, *ROWS[2:]]) + "\n")
    md = _report_md(runs, tmp_path)
    warnings = md.split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert "None:" not in warnings
    assert "a: resumed at step 2 with 0 of the 2 metrics.csv rows before it" in warnings
    (runs / "a" / "metrics.csv").write_text("\n".join([HEADER, *ROWS]) + "\n")
    _record(runs / "a", resumes=[])
    changes = {"derived.eval_windows": [8, 4]}
    _record(runs / "b", resumes=[{"from_step": 2, "volatile_changes": changes}])
    checklist = _checklist(_report_md(runs, tmp_path))
    row = next(line for line in checklist.splitlines() if line.startswith("| Evaluation checkpoints"))
    assert "**DIFFERS**" in row and "held-out set changed on resume at step 2 (8 -> 4 windows)" in row


BLUE = (0.122, 0.467, 0.706)  # tab10's first colour: the first arm's, and a run plot's first line


def _sweep(root: Path, seeds: int, *, throughput: bool) -> Path:
    """A finished sweep of two arms (control, worse) x `seeds` seeds as trmoe.train writes it; each seed
    0.3 nats above the last, so its lines lie apart; `throughput` False: no tok_s column (a short sweep
    logs no window after the warm-up)."""
    import numpy as np
    from test_report_verdicts import control_curve, sweep_dir, write_run

    sweep, job = sweep_dir(root, ["control", "worse"], seeds), 0
    for seed in range(seeds):
        for arm, delta in (("control", 0.0), ("worse", 0.2)):
            run = sweep / str(job)
            write_run(
                run,
                arm=arm,
                seed=seed,
                loss=lambda t, d=delta + 0.3 * seed: control_curve(t) + d,
                tok_s=5000.0,
                rng=np.random.default_rng(job),
            )
            if not throughput:
                with open(run / "metrics.csv") as f:
                    rows = [dict(r, tok_s="") for r in csv.DictReader(f)]
                with open(run / "metrics.csv", "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                    writer.writeheader()
                    writer.writerows(rows)
            job += 1
    return sweep


def _tint(png: Path, lo: float, hi: float, panel: tuple[int, int] = (0, 1), *, apart: bool = False) -> int:
    """Pixels of the first arm's colour at opacity lo..hi over white, in panel i of n (side by side):
    1.0 a solid line, ~0.4-0.5 a faint seed line (alone or over the band). `apart`: only those 3+ pixels
    from any solid one (a solid line's anti-aliased edge is faint too)."""
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(png)[..., :3]
    i, n = panel
    width = pixels.shape[1]
    pixels = pixels[:, i * width // n : (i + 1) * width // n]
    alpha = (1.0 - pixels) / (1.0 - np.array(BLUE))  # per channel: the opacity this pixel would need
    tinted = alpha.max(axis=-1) - alpha.min(axis=-1) < 0.06
    mask = tinted & (alpha.mean(axis=-1) >= lo) & (alpha.mean(axis=-1) <= hi)
    if apart:
        solid = tinted & (alpha.mean(axis=-1) > 0.8)
        near = np.zeros_like(solid)
        for dy in range(-3, 4):
            for dx in range(-3, 4):
                near |= np.roll(np.roll(solid, dy, axis=0), dx, axis=1)
        mask &= ~near
    return int(mask.sum())


@pytest.mark.parametrize("seeds", [1, 2])
def test_every_plot_has_data_and_names_arm_and_seed(tmp_path, seeds):
    """Old code: tok_s.png a bare 0..1 axis in a short sweep, seeds of an arm drawn alike in one colour,
    run plots titled by the job number, one seed's deltas labelled "95% t interval", train loss without
    markers. Read back from the PNGs: their pixels and the titles each records."""
    from PIL import Image

    from trmoe.report.build import build_report

    sweep = _sweep(tmp_path / "sweep", seeds, throughput=seeds == 2)
    rep = build_report([sweep], tmp_path / "report")
    names = {p.name for p in rep.plots}
    assert ("tok_s.png" in names) == (seeds == 2)  # no throughput window: no figure rather than an empty one
    panels = {"loss_vs_tokens.png": 2, "loss_vs_wallclock.png": 2}
    for png in rep.plots:
        assert png.is_file()
        for i in range(panels.get(png.name, 1)):
            assert _tint(png, 0.9, 1.1, (i, panels.get(png.name, 1))) > 40, (png.name, i)  # a drawn line
        title = Image.open(png).text["Title"]
        if png.name.startswith("run_"):
            job = int(png.stem.split("_")[-1])
            arm, seed = ("routing=control", "routing=worse")[job % 2], job // 2
            assert title.startswith(f"{arm}, seed {seed}"), title
    assert len([n for n in names if n.startswith("run_")]) == 2 * seeds

    for name, panel in ((n, (i, 2)) for n in panels for i in range(2)):
        faint = _tint(tmp_path / "report" / "plots" / name, 0.3, 0.6, panel, apart=True)
        assert faint > 150 if seeds == 2 else faint == 0, (name, panel, faint)  # each seed's own faint line

    deltas = Image.open(tmp_path / "report" / "plots" / "paired_deltas.png").text["Title"]
    assert deltas == "control: routing=control"


@pytest.mark.parametrize("seeds", [1, 2])
def test_the_deltas_axis_promises_an_interval_only_when_drawn(tmp_path, monkeypatch, seeds):
    """Old code: "95% t interval" on the axis of one seed's deltas, which draw none. The axis label read
    from each figure as the report saves it."""
    from trmoe.report import plots
    from trmoe.report.build import build_report

    labels, save = [], plots.save

    def keep_labels(fig, path, **kw):
        labels.extend(ax.get_xlabel() for ax in fig.axes if "minus control" in ax.get_xlabel())
        return save(fig, path, **kw)

    monkeypatch.setattr(plots, "save", keep_labels)
    build_report([_sweep(tmp_path / "sweep", seeds, throughput=True)], tmp_path / "report")
    assert labels and all(("95% t interval" in label) == (seeds == 2) for label in labels), labels
