"""Parameter matching, the experiment grids, sweeps with a failing job, and the sweep report."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import CONF_DIR, cli, compose_config
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from presets import GRID_TINY as TINY_RUN

from trmoe.config.param_match import solve_match
from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.errors import UserError
from trmoe.model.transformer import parameter_counts
from trmoe.report.compare import Pair, t975

PILOT_TARGET = 99_487_680
PILOT = ["model=100m", "model.gates=false", f"model.match_params={PILOT_TARGET}"]
DENSE = ["model.num_experts=1", "routing.top_k=1", "model.routed_width=0"]
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
# Small enough that the 11-arm smoke grid runs in about a minute on 2 cores (the grid itself runs 150 steps).


def _grid(name: str):
    """The composed primary config of an experiment, with its hydra node (sweeper params, callbacks)."""
    with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
        return compose("config", overrides=[f"experiment={name}"], return_hydra_config=True)


# --- parameter matching ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arm", "field", "width"),
    [
        (["attention=gqa", *DENSE], "shared_width", 1648),  # dense GQA 8/2
        (["attention=gqa", "model.routed_width=256"], "shared_width", 1392),  # TR-GQA, 4 x 64 routed
        (["attention=mha", *DENSE], "shared_width", 1456),  # dense MHA 8/8
        (["attention=mha", "model.routed_width=160"], "shared_width", 1296),  # TR-MHA, 4 x 40 routed
    ],
)
def test_match_reproduces_the_reference_pilots_exactly(arm, field, width):
    raw = compose_config(*PILOT, *arm)
    cfg = to_config(raw)
    assert getattr(cfg.model, field) == width
    assert raw.model[field] == width  # written back: .hydra/config.yaml and run_config.json show it
    solution = solve_match(cfg)
    assert (solution.field, solution.width, solution.residual, solution.exact) == (field, width, 0, True)
    assert parameter_counts(model_spec(cfg)).total == PILOT_TARGET == solution.total


def test_match_reports_the_closest_width_and_its_residual():
    # Gates add 2 scalars per layer: the 99,487,680 layout is then 20 parameters over, and says so.
    cfg = to_config(compose_config(*PILOT, "model.gates=true", "model.routed_width=256"))
    solution = solve_match(cfg)
    assert (solution.width, solution.residual, solution.exact) == (1392, 20, False)
    # A target between two multiples: the closer one wins; one step of 16 is 3 x 384 x 16 x 10 parameters.
    step = 3 * 384 * 16 * 10
    for offset, width in ((step // 2 - 1, 1648), (step // 2 + 1, 1664), (-(step // 2 - 1), 1648)):
        cfg = to_config(compose_config(*PILOT, *DENSE, f"model.match_params={PILOT_TARGET + offset}"))
        solution = solve_match(cfg)
        assert solution.width == width and abs(solution.residual) <= step // 2
        assert (
            solution.total
            == parameter_counts(model_spec(cfg)).total
            == PILOT_TARGET + offset + solution.residual
        )


def test_match_routed_width_respects_the_number_of_experts():
    # No shared expert: the routed width is solved on multiples of lcm(16, E) so each expert gets an integer.
    cfg = to_config(compose_config(*PILOT, "model.shared_width=0", "model.match_field=routed_width"))
    assert (cfg.model.shared_width, cfg.model.routed_width) == (0, 1648)
    cfg = to_config(
        compose_config(
            *PILOT, "model.shared_width=0", "model.match_field=routed_width", "model.num_experts=3"
        )
    )
    solution = solve_match(cfg)
    assert (
        solution.step == 48
        and cfg.model.routed_width % 48 == 0
        and abs(solution.residual) <= 3 * 384 * 24 * 10
    )


def test_match_errors_are_one_line_user_errors():
    with pytest.raises(UserError, match=r"model.match_params=1000: below the smallest model"):
        to_config(compose_config(*PILOT[:2], "model.match_params=1000"))
    with pytest.raises(UserError, match=r"model.match_multiple=0"):
        to_config(compose_config(*PILOT, "model.match_multiple=0"))
    with pytest.raises(UserError, match=r"model.match_params=-5"):
        to_config(compose_config(*PILOT[:2], "model.match_params=-5"))


# --- the experiment grids ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedding(tmp_path_factory) -> str:
    """A [V, 4] token embedding for the arms that build their tables from one (routing.embedding)."""
    path = tmp_path_factory.mktemp("embedding") / "embedding.npy"
    np.save(path, np.random.default_rng(0).standard_normal((200_019, 4), dtype=np.float32))
    return str(path)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_every_arm_resolves_on_its_target(name, embedding):
    hc = _grid(name)
    assert str(hc.hydra.mode) == "RunMode.MULTIRUN"  # `experiment=<name>` launches the whole grid
    params = hc.hydra.sweeper.params
    arms = params["arm"].split(",")
    assert len(arms) >= (2 if name in ("ladder_smoke", "ladder_cpu") else 4)
    control = hc.hydra.callbacks.report.control
    assert control.removeprefix("arm=") in arms
    if name == "ladder_cpu":
        return  # reads a dataset prepared first (its tokenizer sets the vocabulary): tests/test_ladder.py
    to_config(compose_config(f"experiment={name}"))  # the grid's base config resolves without an arm
    if name.startswith("seeds"):
        assert params["trainer.seed"] == "42,43,44"
        return  # the arms are attention_matched's, checked there
    if hc.ladder.name is not None:
        return  # matched per rung: tests/test_ladder.py
    target = hc.model.match_params
    for arm in arms:
        cfg = to_config(compose_config(f"experiment={name}", f"arm={arm}", f"routing.embedding={embedding}"))
        solution = solve_match(cfg)
        if name.startswith("hash_vs_learned") and cfg.routing.strategy.value == "learned":
            # the hash arms' widths plus its router, L x E x H (the newer grids' E = 6 absorbs it)
            m = cfg.model
            assert solution.residual == m.num_layers * m.num_experts * m.hidden_size, (arm, solution)
            continue
        if name.startswith("first_k"):
            # matched on active parameters; routers in some layers only: the closest unit of shared width
            m = cfg.model
            assert solution.count == "active", (arm, solution)
            if cfg.routing.layers:
                assert 0 < abs(solution.residual) <= 3 * m.hidden_size * m.num_layers // 2, (arm, solution)
                continue
        assert solution.exact and getattr(solution, solution.count) == target, (arm, solution)


@pytest.mark.parametrize(
    "name",
    [
        "routing_ablation",
        "attention_matched",
        "topk",
        "seeds",
        "hash_vs_learned",
        "roller_hash_table",
        "router_persistence",
        "controls_2026",
        "first_k",
    ],
)
def test_each_grid_has_a_smoke_variant_with_the_same_arms(name):
    real, smoke = _grid(name), _grid(f"{name}_smoke")
    assert dict(real.hydra.sweeper.params) == dict(smoke.hydra.sweeper.params)
    assert real.hydra.callbacks.report.control == smoke.hydra.callbacks.report.control
    assert smoke.data.source == "embedded" and smoke.hardware.device == "cpu"
    assert smoke.trainer.steps <= 300 and smoke.model.hidden_size <= 64


def test_attention_matched_grid_is_the_reference_layout():
    widths = {}
    for arm in _grid("attention_matched").hydra.sweeper.params["arm"].split(","):
        cfg = to_config(compose_config("experiment=attention_matched", f"arm={arm}"))
        widths[arm.split("/")[1]] = (
            cfg.model.shared_width,
            cfg.model.routed_width,
            model_spec(cfg).num_kv_heads,
        )
    assert widths == {
        "dense_gqa": (1648, 0, 2),
        "tr_gqa": (1392, 256, 2),
        "dense_mha": (1456, 0, 8),
        "tr_mha": (1296, 160, 8),
    }


def test_match_cli_prints_every_arm_before_launching(tmp_path, monkeypatch, capsys):
    result = cli(["experiment=attention_matched", "--json"], tmp_path, module="trmoe.match")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["match"]["width"], r["match"]["residual"], r["total"]) for r in rows] == [
        (1648, 0, PILOT_TARGET),
        (1392, 0, PILOT_TARGET),
        (1456, 0, PILOT_TARGET),
        (1296, 0, PILOT_TARGET),
    ]
    assert rows[1]["active"] < rows[1]["total"] and rows[0]["active"] == rows[0]["total"]
    # Arms given on the command line, with a sweep over a group; the table names what differs.
    from trmoe.match import main

    monkeypatch.chdir(tmp_path)
    assert (
        main([*PILOT, "attention=gqa,mha", "--arm", " ".join(DENSE), "--arm", "model.routed_width=256"]) == 0
    )
    out = capsys.readouterr().out
    for width in (1648, 1392, 1456, 1200):  # dense and TR (4 x 64 routed) for GQA, then MHA
        assert out.count(f"shared_width={width} ") == 1, out
    assert "attention=mha model.routed_width=256 " in out and "common overrides: model=100m" in out
    assert main([*PILOT, "routing.top_k=5"]) == 2
    assert "error: config error: routing.top_k=5" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing launched, nothing written


def test_match_cli_splits_arms_as_a_shell_does_and_names_what_is_allowed(tmp_path, monkeypatch, capsys):
    from trmoe.match import expand_arms, main

    monkeypatch.chdir(tmp_path)
    arm = "data.text_path='a b.txt' run.name=x"
    assert expand_arms(["data=text"], [arm]) == [["data=text", "data.text_path=a b.txt", "run.name=x"]]
    # an arm that does not compose says what is allowed, as the train app does
    assert main(["model=tiny,nosuch"]) == 2
    assert "error: config error: In 'config': Could not find 'model/nosuch'; allowed: 100m, 1b," in (
        capsys.readouterr().out
    )
    # a group takes one option (Hydra merges a list of them): refused in an arm and for every arm
    assert main(["--arm", "model=[tiny,50m]"]) == 2
    assert (
        "error: config error: model=[tiny,50m]: the model group takes one option" in capsys.readouterr().out
    )
    for argv, line in [
        (["model=[tiny,50m]"], "match: config error: model=[tiny,50m]: the model group takes one option;"),
        (["--arm", "data.text_path='a b.txt"], "match: --arm: No closing quotation"),
        (["--bogus"], "match: unrecognized arguments: --bogus; allowed: see python -m trmoe.match --help"),
    ]:
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"trmoe: {line}"), captured.err
        assert len(captured.err.splitlines()) == 1, captured.err
    assert list(tmp_path.iterdir()) == []


# --- a real sweep and its report ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory) -> Path:
    """routing_ablation_smoke through the CLI, every arm, with a tiny step budget."""
    cwd = tmp_path_factory.mktemp("sweep")
    result = cli(["-m", "experiment=routing_ablation_smoke", *TINY_RUN, "hydra.sweep.dir=grid"], cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sweep report" in result.stderr
    return cwd / "grid"


def test_smoke_sweep_report_has_a_row_per_arm_pairs_checklist_and_plots(smoke_sweep):
    arms = _grid("routing_ablation_smoke").hydra.sweeper.params["arm"].split(",")
    md = (smoke_sweep / "report.md").read_text()
    with open(smoke_sweep / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["arm"] for r in rows) == sorted(f"arm={a}" for a in arms)  # one row per arm
    assert (
        "MFU peaks (run_config.json `mfu_peak`" in md and "(measured 1024^3 float32 GEMM)" in md
    )  # the source
    assert all(r["status"] == "finished" for r in rows)
    assert len({r["params_total"] for r in rows}) == 1 and rows[0]["params_total"] == "12924480"
    assert all(r["match_residual"] == "0" for r in rows)
    assert all(math.isfinite(float(r["final_eval_loss"])) for r in rows)
    for arm in arms:
        assert f"| arm={arm} |" in md
    # Paired comparison: every arm against the grid's control, the dense arm.
    assert "## Paired comparison with the control" in md and "Control arm: `arm=routing_ablation/dense`" in md
    with open(smoke_sweep / "report_pairs.csv", newline="") as f:
        pairs = list(csv.DictReader(f))
    assert len(pairs) == len(arms) - 1 and all(p["n_seeds"] == "1" for p in pairs)
    assert all(p["verdict"].startswith("one seed") for p in pairs)
    # Every final loss as the run ended it (metrics.csv keeps 9 digits: a 1e-4 difference at loss ~12 is
    # not rounded away), so the paired differences are the runs' own.
    with open(smoke_sweep / "report.csv", newline="") as f:
        runs = list(csv.DictReader(f))
    for run in runs:
        status = json.loads((smoke_sweep.parent / run["path"] / "status.json").read_text())  # from the cwd
        assert float(run["final_eval_loss"]) == pytest.approx(status["final_eval_loss"], rel=1e-8, abs=0)
    # The checklist, every item, and no warning: the arms differ only by the swept key.
    assert "## Comparability checklist" in md
    items = [
        "Tokenizer and vocabulary",
        "Data, order and split",
        "Token budget",
        "Parameter count",
        "Seed set",
    ]
    items += [
        "Optimizer and schedule",
        "Precision and hardware",
        "Telemetry and compile",
        "Evaluation checkpoints",
    ]
    for item in [*items, "Throughput interval"]:
        assert f"| {item}" in md
    warnings = md.split("## Warnings")[1].split("## Runs")[0]
    # In a checkout that others commit to while the sweep runs, the code version may really differ between
    # jobs (`git.*`): that warning is correct. Nothing else may differ.
    lines = [w for w in warnings.splitlines() if w.startswith("- ")]
    for line in lines:
        keys = re.findall(r"`([^`]+)`:", line)
        assert keys and all(k.startswith("git.") for k in keys), warnings
    if not lines:
        assert "None: beyond the swept keys" in warnings, warnings
    # PNGs: the grid overlay, paired differences, one per run (throughput only with a window after warm-up:
    # test_report_figures)
    plots = sorted(p.name for p in (smoke_sweep / "plots").glob("*.png"))
    assert {"loss_vs_tokens.png", "paired_deltas.png"} <= set(plots)
    assert len([p for p in plots if p.startswith("run_")]) == len(arms)
    assert all((smoke_sweep / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)


def test_hash_vs_learned_smoke_grid_runs_and_its_report_lists_every_arm(tmp_path):
    arms = _grid("hash_vs_learned_smoke").hydra.sweeper.params["arm"].split(",")
    assert {a.rsplit("/", 1)[1] for a in arms} == {"dense", "modulo_cyclic", "multi_hash", "learned"}
    result = cli(
        ["-m", "experiment=hash_vs_learned_smoke", *TINY_RUN, "hydra.sweep.dir=grid"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    grid = tmp_path / "grid"
    with open(grid / "report.csv", newline="") as f:
        rows = {r["arm"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == sorted(f"arm={a}" for a in arms)
    assert all(
        r["status"] == "finished" and math.isfinite(float(r["final_eval_loss"])) for r in rows.values()
    )
    learned = rows["arm=hash_vs_learned/learned"]
    assert learned["params_total"] == "12924992" and learned["match_residual"] == "512"
    md = (grid / "report.md").read_text()
    assert all(f"| arm={a} |" in md for a in arms)
    job = next(
        p
        for p in grid.iterdir()
        if p.is_dir() and (p / "metrics.csv").exists() and "learned" in (p / "run_config.json").read_text()
    )
    with open(job / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["router_aux"]) >= 1.0 - 1e-6 and last["expert_imbalance"] not in ("", "nan")


@pytest.mark.slow
def test_controls_2026_smoke_grid_reports_verdicts_and_its_distilled_jobs_read_their_parents(tmp_path):
    """The whole controls_2026_smoke grid (12 jobs cut to 12 steps; checkpoints on, the final one only: the
    parents' are what is distilled): every arm finishes at the target, the report holds a TOST verdict and an
    effective speed-up with its 95% interval (= k × ρ) per arm against learned_v3, and each distilled job
    counted the learned_v3 job of its own seed, which ran before it."""
    import shutil

    arms = _grid("controls_2026_smoke").hydra.sweeper.params["arm"].split(",")
    names = [a.rsplit("/", 1)[1] for a in arms]
    assert names.index("learned_v3") < names.index("distilled")
    tiny = [o for o in TINY_RUN if not o.startswith(("checkpoint.", "trainer.steps", "trainer.eval_every"))]
    tiny += ["trainer.steps=12", "trainer.eval_every=4", "checkpoint.every_steps=0", "checkpoint.keep_last=1"]
    run = [
        "-m",
        "experiment=controls_2026_smoke",
        *tiny,
        "routing.distill_tokens=2000",
        "hydra.sweep.dir=grid",
    ]
    result = cli(run, cwd=tmp_path)
    grid = tmp_path / "grid"
    try:
        assert result.returncode == 0, result.stderr[-3000:]
        with open(grid / "report.csv", newline="") as f:
            rows = {r["arm"]: r for r in csv.DictReader(f)}
        assert sorted(rows) == sorted(f"arm={a}" for a in arms)
        assert all(r["status"] == "finished" and r["params_total"] == "12924480" for r in rows.values())
        md = (grid / "report.md").read_text()
        verdicts = md.split("## Verdicts", 1)[1].split("\n## ", 1)[0]
        equivalence, speed = verdicts.split("### Effective speed-up")
        for arm in arms:
            if arm.endswith("/learned_v3"):  # the control
                continue
            line = next(x for x in equivalence.splitlines() if x.startswith(f"| arm={arm} | 2 |"))
            assert re.search(r"\| (better|worse|equivalent within δ=0\.01|inconclusive) \|$", line), line
            assert any(x.startswith(f"| arm={arm} | 2 |") for x in speed.splitlines()), arm
        with open(grid / "report_verdicts.csv", newline="") as f:
            verdict_rows = list(csv.DictReader(f))
        for arm in arms:
            if arm.endswith("/learned_v3"):
                continue
            mine = {v["measure"]: v for v in verdict_rows if v["arm"] == f"arm={arm}"}
            effective = mine["effective_speedup"]
            value, low, high = (float(effective[k]) for k in ("value", "low", "high"))
            assert 0 < low < value < high, (arm, effective)
            k, rho = float(mine["compute_multiplier"]["value"]), float(mine["throughput_ratio"]["value"])
            assert value == pytest.approx(k * rho)
        jobs = {
            p: OmegaConf.load(p / ".hydra" / "overrides.yaml") for p in grid.iterdir() if p.name.isdigit()
        }
        children = [p for p, o in jobs.items() if "arm=controls_2026/distilled" in o]
        assert len(children) == 2
        for child in children:
            record = json.loads((child / "run_config.json").read_text())["distilled"]
            parent = (child / record["run"]).resolve()
            seed = next(o for o in jobs[child] if o.startswith("trainer.seed="))
            assert "arm=controls_2026/learned_v3" in jobs[parent] and seed in jobs[parent]
            assert int(parent.name) < int(child.name)  # ran before it
            assert record["from"] == "arm:learned_v3" and record["tokens"] == 2000 and record["step"] == 12
            read = f"distilled from {parent.name}/checkpoints/step_00000012 (step 12"
            assert read in (child / "train.log").read_text().replace(str(grid) + "/", "")
    finally:
        for checkpoints in grid.glob("*/checkpoints"):  # 150 MB each
            shutil.rmtree(checkpoints)


@pytest.mark.subprocess
def test_first_k_smoke_grid_runs_and_its_report_has_verdicts_and_effective_speedups(tmp_path):
    """first_k_smoke end to end on the CPU (its 8 jobs cut to 30 steps): every arm finishes at its matched
    active count, and the report holds a TOST verdict and an effective speed-up with its 95% interval per arm
    against all_learned_v3 (report_verdicts.csv and report.md)."""
    arms = _grid("first_k_smoke").hydra.sweeper.params["arm"].split(",")
    assert [a.rsplit("/", 1)[1] for a in arms] == [
        "all_hash",
        "first_k_hash",
        "first_k_dense",
        "all_learned_v3",
    ]
    cut = ["trainer.steps=30", "trainer.eval_every=10", "trainer.log_every=2", "trainer.micro_batch=2"]
    cut += ["trainer.seq_len=32", "trainer.eval_batches=1", "hardware.threads=1", "checkpoint.enabled=false"]
    result = cli(["-m", "experiment=first_k_smoke", *cut, "hydra.sweep.dir=grid"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    grid = tmp_path / "grid"
    with open(grid / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and all(r["status"] == "finished" for r in rows)
    actives = {r["arm"]: int(r["params_active"]) for r in rows}
    assert actives["arm=first_k/all_hash"] == actives["arm=first_k/all_learned_v3"] == 12_998_528
    assert actives["arm=first_k/first_k_dense"] == actives["arm=first_k/first_k_hash"] == 12_998_528 - 384
    with open(grid / "report_verdicts.csv", newline="") as f:
        verdicts = list(csv.DictReader(f))
    compared = [a for a in arms if not a.endswith("all_learned_v3")]
    for arm in compared:
        mine = {v["measure"]: v for v in verdicts if v["arm"] == f"arm={arm}"}
        loss = mine["eval_loss"]
        assert loss["n_seeds"] == "2" and loss["p_equiv"] and loss["p_equiv_holm"], (arm, loss)
        assert loss["verdict"] in ("better", "worse", "equivalent within δ", "inconclusive"), (arm, loss)
        effective = mine["effective_speedup"]
        value, low, high = (float(effective[k]) for k in ("value", "low", "high"))
        assert 0 < low < value < high, (arm, effective)
        k, rho = float(mine["compute_multiplier"]["value"]), float(mine["throughput_ratio"]["value"])
        assert value == pytest.approx(k * rho)
    md = (grid / "report.md").read_text()
    assert "### Equivalence (held-out loss)" in md and "Holm" in md and "### Effective speed-up" in md
    for arm in compared:
        row = next(line for line in md.splitlines() if line.startswith(f"| arm={arm} | 2 |") and "×" in line)
        assert row.count("[") >= 2, row  # k, ρ and the effective speed-up with their intervals


def test_sweep_jobs_record_their_status_and_param_match(smoke_sweep):
    jobs = sorted((p for p in smoke_sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert len(jobs) == len(_grid("routing_ablation_smoke").hydra.sweeper.params["arm"].split(","))
    for job in jobs:
        status = json.loads((job / "status.json").read_text())
        assert status["status"] == "finished" and math.isfinite(status["final_eval_loss"])
        rc = json.loads((job / "run_config.json").read_text())
        match = rc["param_match"]
        assert (match["target"], match["residual"], match["exact"]) == (12_924_480, 0, True)
        assert rc["config"]["model"][match["field"]] == match["width"]  # the width that was trained
        assert rc["params"]["total"] == 12_924_480


@pytest.mark.subprocess
def test_report_tables_work_without_matplotlib(smoke_sweep, tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # import matplotlib now raises ImportError
        "from trmoe.report.__main__ import main\n"
        f"sys.exit(main([{str(smoke_sweep)!r}, '--out', {str(tmp_path)!r}, '--quiet']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    md = (tmp_path / "report.md").read_text()
    assert "matplotlib is not installed" in md and not (tmp_path / "plots").exists()
    with open(tmp_path / "report.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(
            _grid("routing_ablation_smoke").hydra.sweeper.params["arm"].split(",")
        )


def _extra_dense_run(cwd: Path, name: str, *overrides: str) -> Path:
    """One more run of the grid's dense arm, outside the sweep."""
    result = cli(
        ["experiment=routing_ablation_smoke", "arm=routing_ablation/dense", "hydra.mode=RUN", *TINY_RUN,
         *overrides, f"hydra.run.dir={name}"],
        cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / name


def _report_warnings(paths: list[Path], out: Path) -> str:
    result = cli([*map(str, paths), "--out", str(out), "--no-plots"], out.parent, module="trmoe.report")
    assert result.returncode == 0, result.stderr
    md = (out / "report.md").read_text()
    return md.split("## Warnings")[1].split("## Runs")[0]


def test_mismatched_seed_count_and_token_budget_raise_warnings(smoke_sweep, tmp_path):
    extra_seed = _extra_dense_run(tmp_path, "seed43", "trainer.seed=43")
    warnings = _report_warnings([smoke_sweep, extra_seed], tmp_path / "seeds")
    assert "Seed set differs between arms" in warnings and "[42, 43]" in warnings, warnings
    assert "Token budget" not in warnings

    longer = _extra_dense_run(tmp_path, "steps3", "trainer.steps=3")
    warnings = _report_warnings([smoke_sweep, longer], tmp_path / "budget")
    assert "Token budget differs" in warnings and "`total_tokens`:" in warnings, warnings
    assert "64 (" in warnings and "steps3)" in warnings
    assert "launched with different overrides beyond the swept keys" in warnings
    assert "`trainer.steps`" in warnings


def test_a_tracker_is_no_training_difference(tmp_path):
    """Two runs of one recipe, one launched with `logger=tensorboard` (what records the run, not what it
    trains): no warning (the report said "launched with different overrides: `logger`" and "Everything else
    (model, ...) differs" for the logger section of the config)."""
    for name, extra in (("plain", []), ("tracked", ["logger=tensorboard"])):
        result = cli(
            [*TINY_RUN, "data=random", "model.vocab_size=512", "hardware=cpu", *extra,
             f"hydra.run.dir=runs/{name}"],
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "runs" / "tracked").glob("events.out.tfevents.*"))  # the tracker did record it
    warnings = _report_warnings([tmp_path / "runs"], tmp_path / "report")
    assert "differs" not in warnings and "different overrides" not in warnings, warnings
    assert "logger" not in warnings, warnings


def test_the_report_says_who_wrote_it_and_the_warmup_it_means(tmp_path):
    """The sweep's own report names the callback that wrote it (it said `python -m trmoe.report`), a rerun
    of the report names the tool; `optimizer.warmup_steps=null` reads as 5% of the horizon, with its steps
    (it said `warmup None`)."""
    tiny = [o for o in TINY_RUN if not o.startswith("optimizer.warmup_steps=")]
    result = cli(["-m", "trainer.seed=1,2", *tiny, "hardware=cpu", "hydra.sweep.dir=sweep"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = compose_config(*tiny).trainer.steps
    md = (tmp_path / "sweep" / "report.md").read_text()
    assert "Written by the sweep's end (hydra.callbacks.report; rerun: `python -m trmoe.report" in md
    assert f"warmup 5% of the horizon ({max(1, round(0.05 * steps))} of {steps} steps)" in md, md
    again = cli([str(tmp_path / "sweep"), "--out", "again", "--no-plots"], tmp_path, module="trmoe.report")
    assert again.returncode == 0, again.stderr
    assert "Written by `python -m trmoe.report` on " in (tmp_path / "again" / "report.md").read_text()


def test_failed_job_is_reported_and_does_not_stop_the_sweep(tmp_path):
    result = cli(
        ["-m", "routing.top_k=1,5,2", "data=random", "model.vocab_size=512", *TINY_RUN, "hardware=cpu",
         "hydra.sweep.dir=sweep"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "sweep job 1 failed: config error: routing.top_k=5" in result.stderr
    sweep = tmp_path / "sweep"
    for job in ("0", "2"):  # the jobs after the failed one ran too
        assert json.loads((sweep / job / "status.json").read_text())["status"] == "finished"
    failed = json.loads((sweep / "1" / "status.json").read_text())
    assert failed["status"] == "failed" and "routing.top_k=5" in failed["error"]
    assert "routing.top_k=5" in failed["overrides"]
    md = (sweep / "report.md").read_text()
    assert "| failed: config error: routing.top_k=5: must be between 1 and model.num_experts=4 |" in md
    assert "1 run(s) failed" in md.split("## Runs")[0]


def test_a_crash_during_training_leaves_a_failed_status(tmp_path, monkeypatch):
    import trmoe.train.loop as loop
    import trmoe.train.trainer as trainer

    def broken(*args, **kwargs):
        raise RuntimeError("optimizer exploded\nsecond line")

    monkeypatch.setattr(trainer, "build_optimizer", broken)
    cfg = compose_config("data=random", "model.vocab_size=512", "hardware=cpu", *TINY_RUN)
    with pytest.raises(RuntimeError, match="optimizer exploded"):
        loop.train(cfg, tmp_path / "r")
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    assert status == {**status, "status": "failed", "error": "RuntimeError: optimizer exploded"}


def test_paired_interval_is_the_student_t_interval():
    # t tables to 9 digits (a 3-digit table was 2e-4 off at one degree of freedom)
    for df, quantile in ((1, 12.706204736), (2, 4.302652730), (30, 2.042272456), (31, 2.039513446)):
        assert t975(df) == pytest.approx(quantile, abs=1e-8)
    pair = Pair(arm=None, seeds=[1, 2, 3], deltas=[-0.019, -0.020, -0.021], arm_mean=None, control_mean=None)
    low, high = pair.interval
    half = 4.302652730 * 0.001 / math.sqrt(3)  # t(2) x sd / sqrt(n)
    assert pair.mean == pytest.approx(-0.02) and (low, high) == pytest.approx((-0.02 - half, -0.02 + half))
    assert pair.verdict == "lower than control"
    wide = Pair(arm=None, seeds=[1, 2], deltas=[-0.01, 0.02], arm_mean=None, control_mean=None)
    assert wide.verdict.startswith("within noise")


def test_report_plots_expert_shares_when_telemetry_was_on(tmp_path):
    from trmoe.report.build import build_report
    from trmoe.train.loop import train

    cfg = compose_config(
        "data=random", "model.vocab_size=512", "hardware=cpu", "telemetry.moe=true", *TINY_RUN
    )
    train(cfg, tmp_path / "runs" / "telemetry")
    rep = build_report([tmp_path / "runs"])
    assert (tmp_path / "runs" / "telemetry" / "telemetry.csv").is_file()
    shares = tmp_path / "runs" / "plots" / "shares_telemetry.png"
    assert shares in rep.plots and shares.read_bytes()[:4] == b"\x89PNG"
    assert "[shares_telemetry](plots/shares_telemetry.png)" in rep.markdown


def test_report_mfu_is_per_device_of_a_multi_device_job(tmp_path):
    from trmoe.report.runs import load_runs
    from trmoe.report.summary import THROUGHPUT_WARMUP_STEPS, flops_per_token, summarize
    from trmoe.train.loop import train

    steps = THROUGHPUT_WARMUP_STEPS + 3  # rows past the warm-up, which the throughput median reads
    tiny = [o for o in TINY_RUN if not o.startswith("trainer.steps=")]
    train(
        compose_config("data=random", "model.vocab_size=512", *tiny, f"trainer.steps={steps}"), tmp_path / "r"
    )
    (run,) = load_runs([tmp_path / "r"])
    one = summarize(run, peak_override=1e12)
    assert one.mfu == pytest.approx(one.median_tok_s * flops_per_token(run) / 1e12) and one.mfu > 0
    run.record["world_size"] = 4  # the same tok/s from 4 devices: each did a quarter of the work
    assert summarize(run, peak_override=1e12).mfu == pytest.approx(one.mfu / 4)


def test_a_sweep_over_seeds_only_is_one_arm(tmp_path):
    """Each launch is an arm when nothing but the seed was swept: two launches of two seeds each, two arms,
    paired seed by seed (not four one-run arms with disjoint seed sets)."""
    for name, routing in (("mc", "modulo_cyclic"), ("rnd", "random")):
        result = cli(
            [
                "-m",
                f"routing={routing}",
                "data=random",
                "model.vocab_size=512",
                *TINY_RUN,
                "trainer.seed=1,2",
                f"hydra.sweep.dir=sweeps/{name}",
            ],
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    one = (tmp_path / "sweeps" / "mc" / "report.md").read_text()
    assert "2 runs (2 finished) in 1 arm;" in one and "| 0 | mc | 1 | finished |" in one
    report = cli(["sweeps", "--control", "mc", "--no-plots"], tmp_path, module="trmoe.report")
    assert report.returncode == 0, report.stderr
    with open(tmp_path / "sweeps" / "report_pairs.csv", newline="") as f:
        (pair,) = list(csv.DictReader(f))
    assert (pair["arm"], pair["control"], pair["n_seeds"]) == ("rnd", "mc", "2")
    assert "Seed set differs" not in (tmp_path / "sweeps" / "report.md").read_text()


def test_two_sweeps_into_one_sweep_dir_are_told_so(tmp_path):
    """A second sweep into the first one's hydra.sweep.dir meets its job directories (<sweep dir>/0, ...),
    whatever run.name says: the advice names hydra.sweep.dir, and the report it writes over the first one's
    says so instead of replacing it silently."""
    sweep = tmp_path / "grid"
    base = ["-m", "data=random", "model.vocab_size=512", "hardware=cpu", *TINY_RUN]
    base.append(f"hydra.sweep.dir={sweep}")
    first = cli([*base, "trainer.seed=1,2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "held the report" not in first.stderr
    second = cli([*base, "trainer.seed=1,2", "optimizer.lr=1e-2", "run.name=other"], tmp_path)
    assert second.returncode == 1, second.stderr[-3000:]
    assert "trmoe: sweep job 0 failed: run directory" in second.stderr
    assert "choose another hydra.sweep.dir" in second.stderr and "another run.name" not in second.stderr
    told = f"{sweep / 'report.md'} held the report of an earlier sweep in this hydra.sweep.dir"
    assert told in second.stderr
