"""experiment=ladder: rungs by the width/depth rule, every arm matched per rung, budgets and branch points,
bad ladders refused whole (one line, exit 2, nothing written), the planner's ladder view, and a tiny real
ladder: its runs' records and the sweep report's Scaling section recomputed from their metrics.csv files."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, compose_config, make_shard, metrics_rows, python
from hydra import compose, initialize_config_module

from trmoe.config.ladder import plan, reference_counts
from trmoe.config.param_match import solve_match
from trmoe.config.resolve import to_config
from trmoe.model.flops import flops_terms
from trmoe.report import scaling_laws as sl
from trmoe.report.build import REPORT_CSV, REPORT_MD, SCALING_CSV
from trmoe.train.ladder import branch_dir, stable_config


def _grid(name: str):
    with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
        return compose("config", overrides=[f"experiment={name}"], return_hydra_config=True)


@pytest.mark.parametrize(("name", "rungs"), [("ladder", (0, 4)), ("ladder_smoke", (0, 1, 2, 3))])
def test_rungs_follow_the_rule_and_every_arm_matches_the_rungs_reference(name, rungs):
    hc = _grid(name)
    lad = hc.ladder
    for rung in rungs:
        hidden = lad.hidden[rung]
        for arm in hc.hydra.sweeper.params["arm"].split(","):
            cfg = to_config(compose_config(f"experiment={name}", f"arm={arm}", f"ladder.rung={rung}"))
            m = cfg.model
            assert (m.hidden_size, m.num_heads) == (hidden, hidden // lad.head_dim)
            assert m.num_kv_heads == max(1, hidden // lad.head_dim // lad.kv_group)
            assert m.num_layers == max(lad.min_layers, round(hidden / lad.aspect))
            solution = solve_match(cfg)
            target = reference_counts(cfg, rung).total
            assert solution.target == target
            if cfg.routing.strategy.value == "learned":  # the hash arms' widths plus its router, L x E x H
                assert solution.residual == m.num_layers * m.num_experts * m.hidden_size
            else:
                assert solution.exact, (arm, rung, solution)
            if arm.endswith("dense"):
                assert (m.routed_width, m.num_experts) == (0, 1)
            else:  # the rule's widths: 2 x hidden each
                assert (m.shared_width, m.routed_width) == (2 * hidden, 2 * hidden)


def test_budgets_branch_from_one_stable_run_whose_lr_is_constant_to_the_last_branch_point():
    raw = compose_config("experiment=ladder_smoke", "arm=hash_vs_learned/modulo_cyclic", "ladder.rung=1")
    cfg = to_config(raw)
    lp = plan(cfg, 256)
    # 10,240 / 20,480 / 40,960 tokens at 256 a step: B = 40, 80, 160; p = 0.8 B
    assert [(b.tokens, b.steps, b.branch_step) for b in lp.budgets] == [
        (10240, 40, 32),
        (20480, 80, 64),
        (40960, 160, 128),
    ]
    stable = to_config(stable_config(raw, lp))
    assert (stable.trainer.steps, stable.optimizer.decay_steps) == (128, 160)
    assert stable.checkpoint.at_steps == [32, 64, 128] and stable.checkpoint.keep_last == 0
    assert branch_dir(Path("grid/3"), lp.budgets[0]) == Path("grid/3-d10240")
    # tokens per parameter: D = x N with N the rung's reference non-embedding active count
    per_param = to_config(compose_config("experiment=ladder", "ladder.rung=2"))
    counts = reference_counts(per_param, 2)
    n = counts.active - counts.embedding
    assert [b.tokens for b in plan(per_param, 4096).budgets] == [
        -(-x * n // 4096) * 4096 for x in (5, 10, 20)
    ]


@pytest.mark.parametrize("arm", ["hash_vs_learned/dense", "hash_vs_learned/modulo_cyclic"])
def test_the_mup_lr_rule_takes_rung_0_as_the_base_shape(arm):
    cfg = to_config(
        compose_config("experiment=ladder_smoke", f"arm={arm}", "ladder.rung=3", "ladder.lr_rule=mup")
    )
    m = cfg.model
    assert (m.parametrization.value, m.mup_base_width, m.hidden_size) == ("mup", 16, 64)
    # the width the match solves scales with the hidden size (None); the rule's other width is rung 0's
    assert m.mup_base_shared_width is None
    assert m.mup_base_routed_width == (None if arm.endswith("dense") else 32)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("ladder.hidden=[64]", "ladder.hidden=[64]: a ladder needs at least 2 rungs"),
        ("ladder.hidden=[64,48,96]", "must grow strictly"),
        ("ladder.tokens=[20480,10240]", "ladder.tokens=[20480, 10240]: the budgets must grow strictly"),
        ("ladder.tokens=[3072,3328]", "two budgets branch at step 10"),  # 12 and 13 steps: p = 10, 10
        ("ladder.tokens_per_param=[]", "one or more positive budgets"),
        ("optimizer.schedule=cosine", "optimizer.schedule=cosine: a ladder branches cooldowns"),
        ("optimizer.warmup_steps=null", "a ladder pins the warmup"),
        ("ladder.rung=4", "ladder.rung=4: allowed: 0..3"),
        ("ladder.name=''", "ladder.name='': a name for the ladder"),
        # 1, 2, 3, 4 heads: max(1, heads // 2) grouped them 1:1, 2:1, 3:1 and 2:1
        ("ladder.kv_group=2", "ladder.kv_group=2: must divide every rung's num_heads [1, 2, 3, 4]"),
        # keys the ladder sets per run would be silently replaced; no checkpoints, no branch points: the
        # whole ladder is refused before its first stable run trains
        ("trainer.steps=5", "trainer.steps=5: a ladder sets it for each run"),
        ("optimizer.decay_steps=50", "optimizer.decay_steps=50: a ladder sets it for each run"),
        ("checkpoint.at_steps=[3]", "checkpoint.at_steps=[3]: a ladder sets it for each run"),
        ("checkpoint.enabled=false", "checkpoint.enabled=false: a ladder's branches start from"),
        ("routing.primary_weight_final=0.9", "routing.primary_weight_final=0.9: scales with the LR horizon"),
        (
            "ladder.lr_rule=mup arm=hash_vs_learned/learned",
            "routing.strategy=learned is not supported under mup",
        ),
        # the report's bootstrap, refused as the app starts, not when the trained sweep is reported
        ("hydra.callbacks.report.scaling_samples=5", "scaling_samples 5: allowed: an integer >= 10"),
        ("hydra.callbacks.report.scaling_samples=many", "scaling_samples many: allowed: an integer >= 10"),
    ],
)
def test_a_bad_ladder_is_one_line_exit_2_and_nothing_written(tmp_path, override, says):
    extra = ["ladder.tokens_per_param=[]", "ladder.tokens=null"] if "tokens_per_param" in override else []
    result = cli(["experiment=ladder_smoke", *extra, *override.split()], tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.subprocess
def test_a_ladder_with_one_rung_is_refused_by_the_real_command(tmp_path):
    result = python("-m", "trmoe.train", "experiment=ladder_smoke", "ladder.hidden=[64]", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "ladder.hidden" in result.stderr and list(tmp_path.iterdir()) == []


def test_the_planner_shows_every_rung_before_anything_runs(tmp_path):
    result = cli(["experiment=ladder_smoke", "--json", "--tok-s", "500"], tmp_path, module="trmoe.plan")
    assert result.returncode == 0, result.stderr
    view = json.loads(result.stdout)["ladder"]
    assert [r["label"] for r in view["rungs"]] == ["h16-l2", "h32-l2", "h48-l3", "h64-l4"]
    assert (view["jobs"], view["runs"]) == (8, 32)  # 4 rungs x 2 arms, each a stable run + 3 branches
    for r in view["rungs"]:
        p = r["params"]
        assert p["active_non_embedding"] == p["active"] - p["embedding"] > 0
        assert [b["tokens"] for b in r["budgets"]] == [10240, 20480, 40960]
        assert all(b["flops"] == r["flops_per_token"] * b["tokens"] for b in r["budgets"])
        # the stable run to step 128, then the decays 40-32, 80-64, 160-128: 184 steps of 256 tokens
        assert r["job_tokens"] == 184 * 256 and r["job_seconds"] == pytest.approx(184 * 256 / 500)
    assert view["total_flops"] == sum(r["job_flops"] for r in view["rungs"]) * 2
    text = cli(["experiment=ladder_smoke"], tmp_path, module="trmoe.plan").stdout
    assert "ladder ladder_smoke  (4 rungs x 2 arms x 1 seed = 8 jobs, 32 runs" in text
    assert "time not estimated" in text and list(tmp_path.iterdir()) == []


ROOT = Path(__file__).resolve().parents[1]


def _ladder_cpu_prepare() -> str:
    """The one command docs/scaling.md gives for ladder_cpu's tokenizer and shards."""
    lines = [
        line.split("#")[0].strip()
        for line in (ROOT / "docs" / "scaling.md").read_text().splitlines()
        if line.startswith("python -m trmoe.data.prepare --embedded") and "--out data/ladder_cpu" in line
    ]
    assert len(set(lines)) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def ladder_cpu_cwd(tmp_path_factory) -> Path:
    """A working directory holding ladder_cpu's dataset, made by the command docs/scaling.md gives (the
    experiment's data.path is relative to it, as from the repository root)."""
    prepare = _ladder_cpu_prepare()
    assert prepare in (ROOT / "conf/experiment/ladder_cpu.yaml").read_text()  # its comment says the same
    command = prepare.split()[3:]
    root = tmp_path_factory.mktemp("ladder_cpu")
    result = cli([*command, "--workers", "0"], root, module="trmoe.data.prepare")
    assert result.returncode == 0, result.stderr
    return root


def test_ladder_cpu_is_compute_dominated_by_its_non_embedding_part_as_the_docs_say(ladder_cpu_cwd):
    """kappa = C / (N D) within a factor 2 of 6 at every rung (the tied head a fraction of the compute), the
    largest budget ~20 tokens per non-embedding parameter, and the docs' rung table is the planner's."""
    result = cli(["experiment=ladder_cpu", "--json"], ladder_cpu_cwd, module="trmoe.plan")
    assert result.returncode == 0, result.stderr
    plan_json = json.loads(result.stdout)
    view = plan_json["ladder"]
    assert (len(view["rungs"]), view["arms"], view["jobs"], view["runs"]) == (4, 2, 8, 32)
    docs = (ROOT / "docs" / "scaling.md").read_text()
    for r in view["rungs"]:
        p = r["params"]
        n = p["active_non_embedding"]
        assert r["kappa"] == pytest.approx(r["flops_per_token"] / n)
        assert 3 <= r["kappa"] <= 12, r
        per_param = [b["tokens_per_param"] for b in r["budgets"]]
        assert per_param[0] >= 4.5 and per_param[-1] >= 15, per_param
        budgets = ", ".join(f"{b['tokens']:,}" for b in r["budgets"])
        row = f"| {r['label']} | {p['total']:,} | {n:,} | {r['kappa']:.3g} | {budgets} |"
        assert row in docs, row
    vocab = int(_ladder_cpu_prepare().split("--vocab-size ")[1].split()[0])  # the documented tokenizer's ids
    model = plan_json["model"]  # rung 0: its embedding rows are the tokenizer's ids, from its tokenizer.json
    assert model["params"]["embedding"] == vocab * model["hidden_size"]
    grid = sum(r["job_tokens"] for r in view["rungs"]) * view["arms"]
    assert f"{grid:,} tokens" in docs
    data = f"data.path={ladder_cpu_cwd / 'data' / 'ladder_cpu'}"
    for rung in range(4):  # both arms land on the rung's total
        for arm in ("hash_vs_learned/dense", "hash_vs_learned/modulo_cyclic"):
            cfg = to_config(
                compose_config("experiment=ladder_cpu", data, f"arm={arm}", f"ladder.rung={rung}")
            )
            assert cfg.model.vocab_size == vocab
            solution = solve_match(cfg)
            assert solution.exact and solution.total == view["rungs"][rung]["params"]["total"], solution


# --- a tiny real ladder -----------------------------------------------------------------------------------

VOCAB = 128


def _markov_tokens(n: int, seed: int) -> np.ndarray:
    """Ids with something to learn: each next id is a fixed function of the previous one, 3 times in 4."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(np.arange(1, VOCAB))
    tokens = np.empty(n, dtype=np.int64)
    tokens[0] = 1
    noise = rng.integers(1, VOCAB, size=n)
    keep = rng.random(n) < 0.75
    for i in range(1, n):
        tokens[i] = successor[tokens[i - 1] - 1] if keep[i] else noise[i]
    tokens[99::100] = 0  # EOS closes a document every 100 ids
    tokens[-1] = 0
    return tokens


TINY_LADDER = [
    "experiment=ladder_smoke",
    "ladder.name=tiny",
    "ladder.hidden=[16,24,32,48]",
    "ladder.rung=0,1,2,3",
    "ladder.head_dim=8",
    "ladder.kv_group=1",  # 2, 3, 4 and 6 heads: one grouping for every rung
    "ladder.aspect=16",
    "ladder.min_layers=1",
    "ladder.tokens=[640,1280,1920]",  # 10, 20, 30 steps of 64 tokens, branched at 8, 16, 24
    f"model.vocab_size={VOCAB}",
    "data=tokens",
    "trainer.micro_batch=2",
    "trainer.seq_len=32",
    "trainer.eval_every=8",
    "trainer.eval_batches=2",
    "optimizer.warmup_steps=2",
    "hardware.threads=1",
    "hydra.sweep.dir=grid",
    "hydra.callbacks.report.scaling_samples=20",  # the report's bootstrap (100 by default)
]


@pytest.fixture(scope="module")
def tiny_ladder(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("ladder")
    data = cwd / "data"
    make_shard(data / "train", _markov_tokens(20_000, 0), vocab_size=VOCAB)
    make_shard(data / "eval", _markov_tokens(4_000, 0)[::-1].copy(), partition="eval", vocab_size=VOCAB)
    result = cli([*TINY_LADDER, f"data.path={data}"], cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "grid"


def _records(grid: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(grid.glob("*/run_config.json"))]


def test_a_tiny_ladder_records_every_run_its_rung_arm_role_budget_and_parent(tiny_ladder):
    records = _records(tiny_ladder)
    assert len(records) == 4 * 2 * 4  # rungs x arms x (stable + 3 branches)
    ladders = [r["ladder"] for r in records]
    assert {(x["rung"], x["rung_label"]) for x in ladders} == {
        (0, "h16-l1"),
        (1, "h24-l2"),
        (2, "h32-l2"),
        (3, "h48-l3"),
    }
    assert {x["arm"] for x in ladders} == {"hash_vs_learned/dense", "hash_vs_learned/modulo_cyclic"}
    for record in records:
        x, run = record["ladder"], Path(record["run_dir"])
        assert x["sweep"] == str(tiny_ladder) and x["budgets"] == [640, 1280, 1920]  # what the report owns
        if x["role"] == "stable":
            assert run.name == str(x["job"])
            assert (
                x["budget_tokens"] is None and x["parent_run"] is None and record["total_tokens"] == 24 * 64
            )
            continue
        assert x["budget_tokens"] == record["total_tokens"] and x["budget_tokens"] in (640, 1280, 1920)
        assert x["parent_step"] == round(0.8 * x["budget_tokens"] / 64)
        # the parent relative to the sweep, the run at its planned place <job>-d<tokens>
        assert run.name == f"{x['parent_run']}-d{x['budget_tokens']}" == f"{x['job']}-d{x['budget_tokens']}"
        parent = json.loads((tiny_ladder / x["parent_run"] / "run_config.json").read_text())["ladder"]
        assert {k: parent[k] for k in ("rung", "arm", "seed")} == {k: x[k] for k in ("rung", "arm", "seed")}
        rows = metrics_rows(run)
        assert int(rows[0]["step"]) == x["parent_step"]  # the branch point is scored first
        assert int(rows[-1]["step"]) * 64 == x["budget_tokens"]


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_tiny_ladders_report_has_the_scaling_section_recomputed_from_its_runs(tiny_ladder):
    """The sweep's report (written by its callback): the Scaling section, every run's N, D, C and L equal
    to a recomputation from its run_config.json and metrics.csv, and each arm's law refitted from those;
    a fitted exponent is finite, or the report says why there is no number."""
    md = (tiny_ladder / REPORT_MD).read_text()
    assert "## Scaling" in md
    section = md.split("## Scaling", 1)[1]
    assert "### Fits per arm" in section and "### Backtest" in section
    assert "(20 replicates)" in section  # hydra.callbacks.report.scaling_samples
    points: dict[str, list] = {}
    rows = [r for r in _csv(tiny_ladder / REPORT_CSV) if r.get("ladder.arm")]
    assert len(rows) == 4 * 2 * 4
    for row in rows:
        run = tiny_ladder.parent / row["path"]  # relative to the launch directory
        record = json.loads((run / "run_config.json").read_text())
        last = metrics_rows(run)[-1]
        p, spec = record["params"], record["model_spec"]
        N, D, L = p["active"] - p["embedding"], float(last["tokens"]), float(last["eval_loss"])
        terms = {k: spec[k] for k in ("num_layers", "num_heads", "head_dim", "hidden_size", "embedding_rows")}
        C = flops_terms(active=p["active"], embedding=p["embedding"], seq_len=32, **terms).total * D
        assert (float(row["scaling.N"]), float(row["scaling.D"]), float(row["scaling.L"])) == (N, D, L)
        assert float(row["scaling.C"]) == pytest.approx(C, rel=1e-12)
        assert (row["scaling.fit_point"] == "yes") == (record["ladder"]["role"] == "branch"), row
        if row["scaling.fit_point"] == "yes":
            points.setdefault(record["ladder"]["arm"], []).append((N, D, L))
    assert sorted(map(len, points.values())) == [12, 12]  # 4 rungs x 3 budgets per arm
    scaling = _csv(tiny_ladder / SCALING_CSV)
    for arm, pts in points.items():
        fits = {r["what"]: r for r in scaling if r["section"] == "fit" and r["arm"] == arm}
        refit = sl.fit(*zip(*pts, strict=True))
        if refit.ok and "law" not in fits:  # identified, its bootstrap too (else one "not identified" row)
            for name, value in refit.law.to_dict().items():
                assert float(fits[name]["estimate"]) == pytest.approx(value, rel=1e-9), (arm, name)
            assert all(math.isfinite(float(fits[x]["estimate"])) for x in ("alpha", "beta"))
        else:  # no number, and the reason
            assert all(r["estimate"] == "" and r["note"] for r in fits.values()), fits
    backtests = [r for r in scaling if r["section"] == "backtest"]
    assert backtests and all(
        r["estimate"] != "" or r["note"].startswith(("not fitted", "no figure")) for r in backtests
    )


# --- a ladder owns its runs: copies, strays, gaps and a moved sweep, made from the tiny ladder's runs ------


def _edit_ladder(run: Path, **values) -> None:
    path = run / "run_config.json"
    record = json.loads(path.read_text())
    record["ladder"].update(values)
    path.write_text(json.dumps(record))


def _stable_of(grid: Path, rung: int, arm: str) -> str:
    return next(
        p.parent.name
        for p in grid.glob("*/run_config.json")
        if (x := json.loads(p.read_text())["ladder"])["role"] == "stable"
        and (x["rung"], x["arm"]) == (rung, arm)
    )


DENSE = "hash_vs_learned/dense"


def _fabricate(grid: Path, case: str) -> tuple[str, str]:
    """Damage a copy of the tiny ladder's sweep as `case` says; returns the run (or planned run) the report
    must name and the words it names it with."""
    job = _stable_of(grid, 1, DENSE)
    if case == "duplicate":  # a backup copy of a branch inside the sweep directory
        shutil.copytree(grid / f"{job}-d640", grid / f"{job}-d640.bak")
        return f"{job}-d640.bak", f"duplicate of {job}-d640"
    if case == "another ladder":  # a branch at a free place whose record names another ladder
        shutil.copytree(grid / f"{job}-d1280", grid / "99-d1280")
        _edit_ladder(grid / "99-d1280", name="other", job=99, parent_run="99")
        return "99-d1280", "from another ladder: other, not this sweep's tiny"
    if case == "another sweep":  # a branch of the same ladder that ran in another sweep directory
        shutil.copytree(grid / f"{job}-d1920", grid / "elsewhere-d1920")
        _edit_ladder(grid / "elsewhere-d1920", sweep="/somewhere/else/grid")
        return "elsewhere-d1920", "from another sweep: run in /somewhere/else/grid"
    if case == "another sweep, stamped":  # as above, where multirun.yaml keeps an unresolved sweep.dir
        yaml = grid / "multirun.yaml"
        text, given = yaml.read_text(), "  sweep:\n    dir: grid\n"
        assert given in text
        yaml.write_text(text.replace(given, "  sweep:\n    dir: grid-${trmoe.stamp:%Y}\n"))
        return _fabricate(grid, "another sweep")
    if case == "missing":  # a deleted branch
        seed = json.loads((grid / job / "run_config.json").read_text())["ladder"]["seed"]
        shutil.rmtree(grid / f"{job}-d1920")
        return f"rung 1, arm {DENSE}, seed {seed}: branch of 1920 tokens at {job}-d1920", ""
    return "", ""  # moved: the copy itself is the move


CASES = ["duplicate", "another ladder", "another sweep", "another sweep, stamped", "missing", "moved"]


@pytest.mark.parametrize("case", CASES)
def test_a_ladders_report_fits_only_the_runs_its_sweep_planned_and_names_the_rest(
    tiny_ladder, tmp_path, case
):
    """Every case on a moved copy of the real tiny sweep (another directory, another working directory):
    the runs the sweep planned at their planned places are the fit points, the others are named with the
    reason and not fitted, a planned run that is gone is named missing."""
    grid = tmp_path / "grid"
    shutil.copytree(tiny_ladder, grid)
    for old in (REPORT_MD, REPORT_CSV, SCALING_CSV):
        (grid / old).unlink()
    run, why = _fabricate(grid, case)
    result = cli(
        [str(grid), "--scaling-samples", "10", "--no-plots", "--quiet"], tmp_path, module="trmoe.report"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    section = (grid / REPORT_MD).read_text().split("## Scaling", 1)[1]
    rows = {r["path"]: r for r in _csv(grid / REPORT_CSV) if r.get("ladder.arm")}
    fitted = [r for r in rows.values() if r["scaling.fit_point"] == "yes"]
    left = [r for r in _csv(grid / SCALING_CSV) if r["section"] in ("excluded", "missing")]
    # only the stable runs are left out for being stable: nothing of the sweep is foreign after the move
    assert not [
        r for r in left if r["section"] == "excluded" and "stable run" not in r["note"] and run not in r["at"]
    ]
    if case == "missing":
        assert len(fitted) == 4 * 2 * 3 - 1 and f"- {run}" in section, section
        assert [r["at"] for r in left if r["section"] == "missing"] == [run]
        return
    assert not [r for r in left if r["section"] == "missing"]
    assert len(fitted) == 4 * 2 * 3  # 4 rungs x 2 arms x 3 budgets: the planned branches, every one
    if case == "moved":
        return
    copy = next(r for p, r in rows.items() if p.endswith(run))
    assert copy["scaling.fit_point"].startswith(why), copy
    assert f"- {run}: {why}" in section
