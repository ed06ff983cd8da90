"""The report's Scaling section (trmoe.report.scaling, ladder, accuracy_fit) on fabricated ladders: run
directories written as a ladder's runs write them (run_config.json with its "ladder" record, params and
model_spec; metrics.csv; status.json), their final losses planted from known laws with noise. No training.

One sweep holds every case, reported once: the control and a better arm (multipliers with intervals, the
backtest, parameters recovered); an arm with a flat loss (no convergence); one with two rungs (too few);
one trained on other budgets and one on other data (refused); a diverged run (left out and listed); the
stable runs of branched rungs (not fit points)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers import cli

from trmoe.model.flops import flops_terms
from trmoe.report import scaling_laws as sl
from trmoe.report.build import REPORT_CSV, REPORT_MD, SCALING_CSV, build_report
from trmoe.report.ladder import Options, kappa_at

CONTROL = sl.Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022, approach 3
BETTER = sl.Law(E=1.69, A=406.4 * 0.7, B=410.7, alpha=0.34, beta=0.28)
HIDDEN = (512, 768, 1024, 1536, 2048)  # rungs: N = 12 L H^2 with L = 4 layers, 10 M ... 200 M
RATIOS = (10, 20, 40)  # tokens per parameter of the budgets
VOCAB, SEQ, LAYERS = 512, 256, 4
SAMPLES = 30


def ACCURACY(loss):  # noqa: N802  (a planted law, as CONTROL): acc/toy of a run of this final loss
    from trmoe.report.accuracy_fit import sigmoid

    return sigmoid(loss, 0.5, 4.0, 3.1, 0.25)


def _params(hidden: int) -> tuple[dict, dict]:
    n = 12 * LAYERS * hidden * hidden
    embedding = VOCAB * hidden
    spec = {"num_layers": LAYERS, "num_heads": hidden // 64, "head_dim": 64, "hidden_size": hidden}
    spec["embedding_rows"] = VOCAB
    return {"total": n + embedding, "active": n + embedding, "embedding": embedding,
            "non_embedding": n}, spec  # fmt: skip


def write_run(path: Path, *, arm: str, rung: int, seed: int, role: str, tokens: int, loss: float,
              data: str = "random", parent: str | None = None, acc: dict | None = None) -> None:  # fmt: skip
    """One finished ladder run as trmoe.train writes it: 4 steps, `tokens` trained, final eval `loss`, and
    downstream accuracies `acc` ({"acc/<task>": value} at the final step, as downstream.tasks logs them)."""
    path.mkdir(parents=True)
    params, spec = _params(HIDDEN[rung])
    config = {"trainer": {"steps": 4, "seed": seed, "seq_len": SEQ}, "data": {"source": data}}
    ladder = {"name": "fab", "rung": rung, "rung_label": f"h{HIDDEN[rung]}", "arm": arm, "seed": seed,
              "role": role, "budget_tokens": tokens if role == "branch" else None,
              "parent_run": parent, "parent_step": 2 if parent else None}  # fmt: skip
    record = {"schema_version": 1, "config": config, "params": params, "model_spec": spec}
    record.update(total_tokens=tokens, ladder=ladder)
    (path / "run_config.json").write_text(json.dumps(record))
    (path / "status.json").write_text(json.dumps({"status": "finished", "final_eval_loss": loss}))
    acc = acc or {}
    lines = [",".join(["step", "tokens", "train_loss", "eval_loss", *acc])]
    for s in (1, 2, 3, 4):
        final = [repr(v) if s == 4 else "nan" for v in (loss, *acc.values())]
        lines.append(",".join([str(s), str(tokens * s // 4), repr(loss + 0.1 * (4 - s)), *final]))
    (path / "metrics.csv").write_text("\n".join(lines) + "\n")


def _n(rung: int) -> int:
    return _params(HIDDEN[rung])[0]["non_embedding"]


def fabricate(root: Path) -> Path:
    """The sweep of the module docstring; its control is named as a grid names it (multirun.yaml)."""
    sweep = root / "sweep"
    sweep.mkdir(parents=True)
    hydra = {"callbacks": {"report": {"control": "arm=dense"}}, "sweeper": {"params": {}}}
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": hydra}))
    rng = np.random.default_rng(0)
    job = iter(range(1000))
    arms = {  # name: (planted law or a flat loss, tokens per parameter, data, rungs)
        "dense": (CONTROL, RATIOS, "random", 5),
        "hash": (BETTER, RATIOS, "random", 5),
        "flat": (None, RATIOS, "random", 3),
        "two_rungs": (CONTROL, RATIOS, "random", 2),
        "other_budgets": (BETTER, (10, 20, 30), "random", 3),
        "other_data": (BETTER, RATIOS, "text", 5),
    }
    for arm, (law, ratios, data, rungs) in arms.items():
        for rung in range(rungs):
            n = _n(rung)
            stable = sweep / str(next(job))  # branched: the control's only (each is a run to read)
            if arm == "dense":
                write_run(stable, arm=arm, rung=rung, seed=0, role="stable", tokens=50 * n, loss=2.5)
            for ratio in ratios:
                loss = float(law.loss(n, ratio * n)) if law else 3.0
                loss *= math.exp(rng.normal(0, 0.005 if law else 0.01))
                acc = {"acc/toy": float(ACCURACY(loss)) + rng.normal(0, 0.002), "acc/flat": 0.25}
                acc = acc if arm in ("dense", "hash") else None
                write_run(sweep / str(next(job)), arm=arm, rung=rung, seed=0, role="branch", tokens=ratio * n,
                          loss=loss, data=data, parent=stable.name, acc=acc)  # fmt: skip
    # the hash arm's extra branch at the smallest rung diverged: left out, listed
    write_run(sweep / str(next(job)), arm="hash", rung=0, seed=0, role="branch", tokens=80 * _n(0),
              loss=math.nan, parent="0")  # fmt: skip
    # and one whose final metrics.csv row was cut short by a kill mid-write: no fit point
    cut = sweep / str(next(job))
    write_run(cut, arm="hash", rung=1, seed=0, role="branch", tokens=80 * _n(1), loss=3.0, parent="4")
    (cut / "metrics.csv").write_text((cut / "metrics.csv").read_text()[:-4])
    return sweep


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    sweep = fabricate(tmp_path_factory.mktemp("ladder"))
    rep = build_report([sweep], scaling=Options(samples=SAMPLES), make_plots=False)  # 80 runs: ~0.3 s
    # of CPU per run's plot; the Scaling plots are drawn below
    return sweep, rep


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _scaling(sweep: Path, section: str, arm: str) -> list[dict]:
    return [r for r in _rows(sweep / SCALING_CSV) if r["section"] == section and r["arm"] == arm]


def test_the_section_has_multipliers_with_intervals_and_a_backtest(report):
    sweep, rep = report
    md = (sweep / REPORT_MD).read_text()
    scaling = md.split("## Scaling", 1)[1]
    for title in ("Fits per arm", "Compute multiplier against the control", "Predicted loss at the targets",
                  "Backtest"):  # fmt: skip
        assert f"### {title}" in scaling, title
    assert "Control: `dense`" in scaling  # the grid's hydra.callbacks.report.control
    k = _scaling(sweep, "multiplier", "hash")
    assert [r["at"] for r in k] == [f"rung h{h}" for h in HIDDEN] + ["1b", "8b"]
    control, arm = (a for a in rep.scaling.arms if a.name in ("dense", "hash"))
    for row in k[:5]:  # within the runs: the planted multiplier, inside the interval
        C = float(row["C"])
        kappa = (
            kappa_at(control.points, [C], rep.scaling.extra),
            kappa_at(arm.points, [C], rep.scaling.extra),
        )
        truth = float(sl.multiplier(CONTROL, BETTER, np.array([C]), *kappa)[0])
        assert float(row["low"]) < float(row["estimate"]) < float(row["high"])
        assert float(row["low"]) <= truth <= float(row["high"]) and truth > 1, row
        assert "within the runs" in row["note"] or "decades beyond" in row["note"]
    for row in k[5:]:  # the 1b and 8b targets: many decades beyond 200 M parameters, flagged
        assert "EXTRAPOLATED" in row["note"] or row["at"] == "1b"  # 1b: one decade beyond, not flagged
    assert float(k[-1]["decades"]) > 1 and "EXTRAPOLATED" in k[-1]["note"]
    fits = {r["what"]: r for r in _scaling(sweep, "fit", "dense")}
    assert set(fits) == {"E", "A", "B", "alpha", "beta", "gamma"}
    for name in fits:
        assert float(fits[name]["low"]) < float(fits[name]["estimate"]) < float(fits[name]["high"]), name
    for name in ("alpha", "beta", "E"):  # the planted law inside its intervals
        assert float(fits[name]["low"]) <= CONTROL.to_dict()[name] <= float(fits[name]["high"]), name
    back = _scaling(sweep, "backtest", "dense")[0]
    assert back["note"].startswith("covered") and float(back["low"]) < float(back["high"])
    pred = _scaling(sweep, "prediction", "hash")
    assert [r["at"] for r in pred] == ["1b", "8b"] and float(pred[1]["estimate"]) < float(pred[0]["estimate"])


def test_each_honesty_check_fires(report):
    sweep, _ = report
    md = (sweep / REPORT_MD).read_text()
    for arm, reason in (("flat", "did not converge"), ("two_rungs", "too few rungs (2 sizes")):
        (row,) = _scaling(sweep, "fit", arm)
        assert row["estimate"] == "" and reason in row["note"], row
        assert all(r["estimate"] == "" for r in _scaling(sweep, "multiplier", arm))
    budgets = _scaling(sweep, "multiplier", "other_budgets")
    assert budgets and all(
        r["estimate"] == "" and "differ in 12 (rung, tokens) cells" in r["note"] for r in budgets
    )
    (back,) = _scaling(sweep, "backtest", "other_budgets")  # 3 rungs: a fit of the smaller 2 cannot be
    assert back["estimate"] == "" and back["note"].startswith("not fitted: too few rungs (2 sizes")
    data = _scaling(sweep, "multiplier", "other_data")
    assert data and all(r["estimate"] == "" and r["note"] == "not compared: the arms' runs were trained on "
                        "other data (config `data`)" for r in data)  # fmt: skip
    (diverged,) = [
        r for r in _rows(sweep / SCALING_CSV) if r["section"] == "excluded" and "diverged" in r["note"]
    ]
    assert diverged["arm"] == "hash" and f"{diverged['at']}: diverged" in md  # listed in report.md
    (cut,) = [
        r for r in _rows(sweep / SCALING_CSV) if r["section"] == "excluded" and "truncated" in r["note"]
    ]
    assert cut["note"].startswith(
        "records disagree: metrics.csv ends at step 3, but status.json says finished"
    )
    assert f"{cut['at']}: records disagree" in md
    stable = [
        r for r in _rows(sweep / SCALING_CSV) if r["section"] == "excluded" and "stable run" in r["note"]
    ]
    assert len(stable) == 5  # the control's stable runs: every one was branched
    assert "- `acc/flat`: not fitted: the accuracy does not vary over the runs." in md


def test_report_csv_equals_a_recomputation_from_the_runs_files(report):
    """N, D, C and L of every ladder run from its own run_config.json and metrics.csv, and the fitted law
    of each arm refitted from those."""
    sweep, rep = report
    points: dict[str, list] = {}
    for row in _rows(sweep / REPORT_CSV):
        record = json.loads((Path(row["path"]) / "run_config.json").read_text())
        if not (Path(row["path"]) / "metrics.csv").read_text().endswith("\n"):  # the cut one: no figures
            assert row["scaling.D"] == "" and row["scaling.fit_point"].startswith("records disagree")
            continue
        with open(Path(row["path"]) / "metrics.csv", newline="") as f:
            last = list(csv.DictReader(f))[-1]
        p, spec = record["params"], record["model_spec"]
        N, D, L = p["active"] - p["embedding"], float(last["tokens"]), float(last["eval_loss"])
        C = flops_terms(active=p["active"], embedding=p["embedding"], seq_len=SEQ, **spec).total * D
        assert (float(row["scaling.N"]), float(row["scaling.D"])) == (N, D)
        assert float(row["scaling.C"]) == pytest.approx(C, rel=1e-12)
        assert float(row["scaling.L"]) == L or (math.isnan(L) and row["scaling.L"] == "nan")
        if row["scaling.fit_point"] == "yes":
            points.setdefault(record["ladder"]["arm"], []).append((N, D, L))
    assert sum(map(len, points.values())) == 3 * 5 * 3 + 2 * 3 * 3 + 2 * 3
    for arm in ("dense", "hash"):
        law = sl.fit(*zip(*points[arm], strict=True)).law
        fits = {r["what"]: float(r["estimate"]) for r in _scaling(sweep, "fit", arm)}
        for name, value in law.to_dict().items():
            assert fits[name] == pytest.approx(value, rel=1e-9), (arm, name)


def _panels(png: Path) -> list[dict]:
    """What the PNG says each panel holds (its `Axes` text chunk: trmoe.report.scaling_plots.describe)."""
    from PIL import Image

    return json.loads(Image.open(png).text["Axes"])


def _edge_pixels(png: Path) -> np.ndarray:
    import matplotlib.image

    pixels = matplotlib.image.imread(png)[..., :3]
    return np.concatenate([pixels[:2].reshape(-1, 3), pixels[-2:].reshape(-1, 3),
                           pixels[:, :2].reshape(-1, 3), pixels[:, -2:].reshape(-1, 3)])  # fmt: skip


def test_the_plots_show_the_runs_mark_where_they_end_and_the_targets_beyond(report, tmp_path):
    """Read back from the PNGs: the compute axis spans the runs (before: out to the 8b target, 2.8 decades
    beyond, every run in its left tenth), "last run" marks the end of the data, the targets are named
    beyond it, nothing drawn is infinite or a finite stand-in for it (before: a band's unbounded end drawn
    at 1e6), and nothing is cut at the image's edge (titles, labels, the marks right of the axis)."""
    from trmoe.report.scaling_plots import plot_scaling

    _, rep = report
    written = plot_scaling(rep.scaling, tmp_path)
    names = ["scaling_loss_vs_compute.png", "scaling_multiplier.png", "scaling_backtest.png"]
    assert [p.name for p in written] == names
    cs = [p.C for a in rep.scaling.arms for p in a.points]
    for png in written[:2]:  # compute on x
        (panel,) = _panels(png)
        lo, hi = panel["xlim"]
        assert lo <= min(cs) and max(cs) <= hi, (png.name, panel["xlim"])
        assert math.log10(hi / max(cs)) < 0.5 and math.log10(min(cs) / lo) < 0.5, (png.name, panel["xlim"])
        span = math.log10(hi / lo)  # the marks right of the axis: within a tenth of its width
        assert lo * (1 - 1e-9) <= panel["x"][0] and math.log10(panel["x"][1] / hi) <= 0.1 * span, panel["x"]
        (bottom, top), (y0, y1) = panel["ylim"], panel["y"]  # drawn within the axis (up to rounding)
        assert bottom * (1 - 1e-9) <= y0 and y1 <= top * (1 + 1e-9) and top < 1e6, (png.name, panel["y"])
        assert panel["infinite"] == 0, png.name
        assert "last run" in panel["texts"], png.name
        note = next(t for t in panel["texts"] if t.startswith("targets"))
        assert "1b: C 8.99e+19, 1.0 decades beyond" in note and "8b: C 6.4e+21, 2.8 decades beyond" in note
    for png in written:
        (panel,) = _panels(png)
        assert panel["xlabel"] and (panel["ylabel"] or png.name == "scaling_backtest.png")
        assert (_edge_pixels(png) > 0.99).all(), png.name  # a white margin all round: nothing cut


def test_an_unbounded_band_is_clipped_to_the_axis_and_marked_on_its_edge(tmp_path):
    """A band whose upper end is infinite (a multiplier beyond the control's floor) or far beyond the axis,
    then with no lower end either (not estimable: nan, inf): filled to the axis's edges, a triangle on each
    edge where it goes on, and no value of it drawn beyond the axis (before: an infinite end drawn at 1e6);
    where there is no interval at all (nan, nan), no band."""
    from trmoe.report.plots import pyplot
    from trmoe.report.scaling_plots import _band, _save

    plt = pyplot()
    fig, ax = plt.subplots()
    x = np.geomspace(1e10, 1e12, 60)
    high = np.select([x < 1e11, x < 2e11, x < 6e11], [3.0, 1e9, math.inf], math.nan)
    low = np.where(x < 3e11, 0.5, math.nan)
    ax.plot(x, np.ones_like(x))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(0.1, 10.0)
    assert _band(ax, x, low, high, "tab:blue", (0.1, 10.0))
    (panel,) = _panels(_save(fig, tmp_path / "band.png"))
    assert panel["infinite"] == 0 and panel["ylim"] == [0.1, 10.0]
    assert panel["y"] == pytest.approx([0.1, 10.0], rel=1e-9)  # the band's ends at the axis's edges
    marks = {m: [xy for line in ax.lines if line.get_marker() == m for xy in line.get_xydata()] for m in "^v"}
    assert marks["^"] and all(y == 10.0 and 1e11 <= x < 6e11 for x, y in marks["^"])
    assert marks["v"] and all(y == 0.1 and 3e11 <= x < 6e11 for x, y in marks["v"])
    (band,) = ax.collections
    assert max(v[0] for p in band.get_paths() for v in p.vertices) < 6e11  # none without an interval


def test_downstream_accuracy_is_fitted_through_the_loss(report):
    """Two-step (loss -> accuracy): the planted sigmoid of acc/toy is recovered from the dense and hash arms'
    runs, and each target's accuracy is the sigmoid at its predicted loss; too few runs: not fitted."""
    from trmoe.report.accuracy_fit import fit_accuracy, predict_interval

    sweep, rep = report
    (toy,) = [f for f in rep.scaling.accuracy if f.column == "acc/toy"]
    assert toy.reason == "" and toy.points == 2 * 5 * 3
    for loss in (2.8, 3.1, 3.4):
        assert toy.predict(loss) == pytest.approx(float(ACCURACY(loss)), abs=0.01)
    hash_arm = next(a for a in rep.scaling.arms if a.name == "hash")
    est, low, high = predict_interval(toy, hash_arm.predictions["1b"])
    assert low < est < high and est == pytest.approx(float(ACCURACY(hash_arm.predictions["1b"][0])), abs=0.01)
    line = next(x for x in (sweep / REPORT_MD).read_text().splitlines() if x.startswith("- `acc/toy`"))
    assert f"`hash` at `1b`: {est:.3g}" in line and "over 30 runs" in line
    assert "too few runs" in fit_accuracy("acc/toy", [3.0] * 5, [0.3] * 5).reason


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--scaling-n", "embedding"], "--scaling-n embedding: allowed: non_embedding_active, active"),
        (["--scaling-targets", "1b,9b"], "--scaling-targets 1b,9b: allowed: model profiles"),
        (["--scaling-samples", "5"], "--scaling-samples 5: allowed: an integer >= 10"),
    ],
)
def test_bad_scaling_options_are_one_line_and_write_nothing(tmp_path, args, needle):
    run = tmp_path / "sweep" / "0"
    write_run(run, arm="dense", rung=0, seed=0, role="branch", tokens=10 * _n(0), loss=3.0)
    before = sorted(p.name for p in run.iterdir())
    result = cli([str(tmp_path / "sweep"), *args], cwd=tmp_path, module="trmoe.report")
    assert result.returncode == 2 and needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in run.iterdir()) == before and not (tmp_path / "sweep" / REPORT_MD).exists()


def test_targets_are_counted_inside_a_running_hydra_app():
    """The sweep's report callback runs inside the train app's Hydra: the targets' composition sets it
    aside and puts it back (before: "GlobalHydra is already initialized", and no sweep report)."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from trmoe.report.scaling_targets import target

    with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
        running = GlobalHydra.instance().hydra
        assert target("tiny").N > 0
        assert GlobalHydra.instance().hydra is not None and GlobalHydra.instance().is_initialized()
        assert type(GlobalHydra.instance().hydra) is type(running)
    assert not GlobalHydra.instance().is_initialized()


def test_a_ladder_whose_runs_are_all_left_out_says_so(tmp_path):
    """Every run diverged: no fit, no plot, and the section lists them (no crash on an empty ladder)."""
    sweep = tmp_path / "sweep"
    for i in range(2):
        write_run(
            sweep / str(i), arm="dense", rung=i, seed=0, role="branch", tokens=10 * _n(i), loss=math.nan
        )
    rep = build_report([sweep], scaling=Options(targets=("tiny",)))
    md = (sweep / REPORT_MD).read_text()
    assert "Left out of the fits (2):" in md and "### Fits per arm" not in md
    assert not [p for p in rep.plots if p.name.startswith("scaling_")]


def test_the_n_of_each_kind_and_the_options_that_choose_it():
    from trmoe.report.ladder import N_KINDS, n_of, parse_scaling

    counts = {"total": 1000, "active": 400, "embedding": 100, "non_embedding": 900}
    assert {k: n_of(counts, k) for k in N_KINDS} == {
        "non_embedding_active": 300, "active": 400, "non_embedding": 900, "total": 1000,
    }  # fmt: skip
    assert n_of({"total": 1}, "active") is None  # a record without the counts: no N
    options = parse_scaling("active", " 8b,tiny ")
    assert (options.n_kind, options.targets) == ("active", ("8b", "tiny"))
