"""A run directory's records are never lost or silently wrong (docs/reliability.md, "The run directory's
records"): bookkeeping files are never followed through links, metrics.csv is matched by column name,
run.overwrite=true removes every file of the layout, every JSON written is valid JSON, and a directory left
by a launch killed before its record is refused."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import metrics_rows, train_in_process, tree_digest
from presets import RESUME_SMALL

from trmoe.durable import json_text, number
from trmoe.errors import UserError
from trmoe.run import records
from trmoe.run.rundir import BOOKKEEPING, LOCK, RunDir

# ------------------------------------------------------------------ bookkeeping files are never links


@pytest.mark.parametrize("name", [".lock", "status.json", "metrics.csv", "checkpoints/latest"])
def test_a_bookkeeping_file_that_is_a_link_is_refused_and_its_target_untouched(small_run, tmp_path, name):
    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir, symlinks=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).symlink_to(outside)
    before = tree_digest(run_dir)
    with pytest.raises(UserError, match=rf"{name}: a symbolic link .*nothing was changed") as e:
        train_in_process(run_dir, *RESUME_SMALL, "trainer.steps=6")
    assert "\n" not in str(e.value)
    assert outside.read_text() == "not the run's\n"
    assert tree_digest(run_dir) == before and (run_dir / name).is_symlink()


def test_every_bookkeeping_name_is_checked(tmp_path):
    """RunDir.linked() sees a link at every name BOOKKEEPING lists (the lock refuses the launch by it)."""
    run = RunDir(tmp_path)
    for name in BOOKKEEPING:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(tmp_path / "nowhere")
    assert run.linked() == list(BOOKKEEPING)


# ----------------------------------------------------------------- metrics.csv: columns by name


def _permute_columns(path: Path) -> None:
    """The same rows with the columns in reverse order (a hand edit, another tool's rewrite)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([row[::-1] for row in rows])


def test_a_resume_matches_metrics_columns_by_name(small_run, tmp_path):
    """Old code: the trimmer read the step from the first column (here `loss_spikes`, 0 in every row) and
    the writer appended by position; rows 0-4 were dropped or garbled."""
    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # resume from step 2
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    before = {int(r["step"]): r for r in metrics_rows(run_dir)}
    _permute_columns(run_dir / "metrics.csv")
    train_in_process(run_dir, *RESUME_SMALL, "trainer.steps=6")
    after = {int(r["step"]): r for r in metrics_rows(run_dir)}
    assert sorted(after) == [0, 1, 2, 3, 4, 5, 6]
    for step in (0, 1, 2):
        assert after[step] == before[step]
    assert math.isfinite(float(after[6]["eval_loss"])) and int(after[6]["tokens"]) > int(after[4]["tokens"])
    assert (run_dir / "metrics.csv.orig").is_file()


def test_trim_and_continue_keep_rows_by_the_step_column(tmp_path):
    path = tmp_path / "telemetry.csv"
    path.write_text("layer,step,value\n0,1,a\n1,1,b\n0,2,c\n1,2,d\n0,3,e\n")
    assert records.trim_csv(path, 2) == 4
    assert path.read_text() == "layer,step,value\n0,1,a\n1,1,b\n0,2,c\n1,2,d\n"
    path.write_text("value,other\n1,2\n")
    with pytest.raises(UserError, match="no `step` column"):
        records.trim_csv(path, 2)


# --------------------------------------------------------------- run.overwrite removes the whole run


def test_run_overwrite_removes_every_file_of_the_layout(small_run, tmp_path):
    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    stale = {"eval/4.json": "{}", "metrics.csv.orig": "old", "profile/t.json": "{}", "logs/rank_1.log": "x"}
    for name, text in stale.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    train_in_process(run_dir, *RESUME_SMALL, "trainer.seed=3", "trainer.resume=never", "run.overwrite=true")
    assert not any((run_dir / name).exists() for name in stale)
    files, dirs = RunDir(run_dir).removable()
    names = {p.name for p in files + dirs}
    from trmoe.run import rundir

    layout = {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and "/" not in v}
    layout |= set(rundir.TRACKER_DIRS)
    layout.discard(rundir.TENSORBOARD_EVENTS)  # a glob, not a name: its files are removable when there
    assert layout - names == {LOCK, "latest"}  # held by the launch / inside checkpoints/


# --------------------------------------------------------------------------- valid JSON everywhere


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"bare {name}: not JSON")

    return json.loads(text, parse_constant=refuse)


def test_every_json_a_diverged_run_writes_is_valid_json(tmp_path):
    """lr 1e30 breaks the weights after step 1: NaN losses, a NaN final eval loss (old code: bare NaN in
    status.json and meta.json); the report reads the figure back as NaN and flags the run."""
    run_dir = tmp_path / "r"
    final = train_in_process(run_dir, *RESUME_SMALL, "optimizer.lr=1e30", "guard.skip_nonfinite=false")
    assert math.isnan(final)
    written = sorted(run_dir.rglob("*.json"))
    assert {p.name for p in written} >= {"status.json", "run_config.json", "meta.json"}
    for path in written:
        _strict(path.read_text())
    assert number(_strict((run_dir / "status.json").read_text())["final_eval_loss"]) != number(0)
    assert math.isnan(number(_strict((run_dir / "status.json").read_text())["final_eval_loss"]))
    # the run resumes from such a checkpoint (its meta.json verifies) and the report flags it
    from trmoe.report.runs import load_runs
    from trmoe.report.summary import summarize

    summary = summarize(load_runs([run_dir])[0])
    assert summary.diverged and math.isnan(summary.final_eval)


def test_json_text_names_non_finite_numbers_and_number_reads_them_back():
    text = json_text({"a": [math.nan, math.inf, -math.inf, 1.5]})
    assert _strict(text) == {"a": ["NaN", "Infinity", "-Infinity", 1.5]}
    values = [number(v) for v in _strict(text)["a"]]
    assert math.isnan(values[0]) and values[1:] == [math.inf, -math.inf, 1.5]
    assert number(True) is None and number("3") is None and number(None) is None


# json.dumps where its text is never a file or an output: a hash, a grouping key, a message, a comparison
IN_MEMORY_JSON = {
    "report/checks.py": "a config value flattened to a comparable string",
    "report/ladder.py": "a run's data config as a comparison key (arms on other data are refused)",
    "data/build.py": "the hash of a data description",
    "eval/lm.py": "a grouping key of the harness's requests",
    "run/checkpoint.py": "meta.json as written before json_text (old seals verify), a message's excerpt, "
    "the hash of a checkpoint's file records (files_digest)",
    "run/identity.py": "a JSON round trip of data_info into plain values, and the hash of the critical keys",
}


def test_every_json_writer_goes_through_json_text():
    """The class, not the two files of the report: a JSON that trmoe writes (a file, stdout, a tracker)
    comes from durable.json_text, never from json.dump(s), which writes bare NaN. 151d5ed wrote status.json
    and meta.json with json.dumps; trmoe.bench lrtransfer --out (whose diverged learning rates have a NaN
    loss) did until this test."""
    import ast

    import trmoe

    package = Path(trmoe.__file__).parent
    found = set()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and f.attr in ("dump", "dumps"):
                if isinstance(f.value, ast.Name) and f.value.id == "json" and rel != "durable.py":
                    found.add(rel)
    assert sorted(found - set(IN_MEMORY_JSON)) == [], "write JSON with trmoe.durable.json_text"
    assert sorted(set(IN_MEMORY_JSON) - found) == [], "no longer calls json.dumps: remove it from the list"


# --------------------------------------------------------- a launch killed before its run_config.json


def test_a_directory_left_before_the_run_record_is_refused(small_run, tmp_path):
    """What a launch killed between its first writes and run_config.json leaves: .hydra/, train.log and
    status.json. Another config is refused with the diff against its .hydra/config.yaml (old code: it silently
    reused the directory); the same config starts it again from step 0 (a ladder's branch killed as it
    starts: tests/test_ladder_resume.py); with no readable .hydra/config.yaml it is refused."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    for name in (".hydra", "train.log", "status.json"):
        src = small_run / name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, run_dir / name)
    before = tree_digest(run_dir)
    with pytest.raises(
        UserError, match=r"holds a different run .* from its .hydra/config.yaml:\n  trainer.seed  42 -> 5\n"
    ):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.seed=5")
    assert tree_digest(run_dir) == before
    same = tmp_path / "same"
    shutil.copytree(run_dir, same)
    train_in_process(same, *RESUME_SMALL)
    assert json.loads((same / "run_config.json").read_text())["resumes"][0]["mode"] == "restart"
    (run_dir / ".hydra" / "config.yaml").write_text("[unclosed")
    before = tree_digest(run_dir)
    with pytest.raises(UserError, match=r"holds files of a run \(train.log, .hydra\).*run.overwrite=true"):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.seed=5")
    assert tree_digest(run_dir) == before
    train_in_process(run_dir, *RESUME_SMALL, "trainer.seed=5", "trainer.resume=never", "run.overwrite=true")
    assert json.loads((run_dir / "run_config.json").read_text())["config"]["trainer"]["seed"] == 5
    # status.json alone (a sweep job that failed on its config) holds no run: a fixed launch may use it
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "status.json").write_text('{"status": "failed", "error": "config error"}\n')
    train_in_process(lone, *RESUME_SMALL)
    assert json.loads((lone / "status.json").read_text())["status"] == "finished"


# ------------------------------------------------------- the held-out set follows micro_batch: kept apart


def test_a_resume_that_changes_the_held_out_set_keeps_best_eval_to_the_last_set(small_run, tmp_path):
    """micro_batch 4 -> 2 (grad_accum 1 -> 2 keeps the tokens per step) halves the held-out set (8 -> 4
    windows): run_config.json records it, and the report's best eval no longer mixes the two sets (old code:
    the minimum over both, without a word)."""
    from trmoe.report.runs import load_runs
    from trmoe.report.summary import summarize

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # resume from step 2
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    train_in_process(run_dir, *RESUME_SMALL, "trainer.micro_batch=2", "trainer.grad_accum=2")
    record = json.loads((run_dir / "run_config.json").read_text())
    assert record["derived"]["eval_windows"] == 4
    assert record["resumes"][-1]["volatile_changes"]["derived.eval_windows"] == [8, 4]
    summary = summarize(load_runs([run_dir])[0])
    evals = {int(r["step"]): float(r["eval_loss"]) for r in metrics_rows(run_dir) if r["eval_loss"] != "nan"}
    assert summary.best_eval == min(v for step, v in evals.items() if step > 2)
    assert "held-out set changed on resume at step 2 (8 -> 4 windows)" in summary.held_out_note
