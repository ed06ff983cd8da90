"""`python -m trmoe.report` on bad input: one line naming the option or file and what is allowed, exit code
2, nothing written; and runs whose records cannot be read are reported as such instead of crashing it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import cli, compose_config
from presets import FAST_CPU

# Two steps of a tiny model on random tokens: a real run directory in well under a second.
TINY = [*FAST_CPU, "trainer.steps=2", "trainer.micro_batch=2", "trainer.eval_every=0", "trainer.log_every=1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from trmoe.train.loop import train

    threads = torch.get_num_threads()
    path = tmp_path_factory.mktemp("report_cli") / "runs" / "r1"
    try:
        train(compose_config(*TINY), path)
    finally:
        torch.set_num_threads(threads)
    return path


def _report(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return cli(list(args), cwd=cwd, module="trmoe.report")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line_error(result: subprocess.CompletedProcess, *expected: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_out_that_is_a_file_is_one_line_and_writes_nothing(run_dir, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me\n")
    before = _files(run_dir.parent)
    for out in (target, target / "sub"):
        result = _report(str(run_dir), "--out", str(out), "--no-plots", cwd=tmp_path)
        _one_line_error(result, f"--out {out}", f"{target} is a file" if out != target else "it is a file")
        assert "not a directory" in result.stderr
    assert target.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert _files(run_dir.parent) == before


@pytest.mark.parametrize("value", ["-3", "nan", "0", "inf", "fast"])
def test_peak_tflops_must_be_a_positive_number(run_dir, tmp_path, value):
    result = _report(str(run_dir), "--out", "rep", f"--peak-tflops={value}", "--no-plots", cwd=tmp_path)
    _one_line_error(result, f"--peak-tflops {value}", "allowed: a positive number")
    assert not (tmp_path / "rep").exists()


def test_control_that_matches_no_arm_is_one_line_and_writes_nothing(run_dir, tmp_path):
    result = _report(str(run_dir), "--out", "rep", "--control", "routing=bogus", "--no-plots", cwd=tmp_path)
    _one_line_error(result, "--control routing=bogus", "matches no arm", "`r1`")
    assert not (tmp_path / "rep").exists()
    ok = _report(str(run_dir), "--out", "rep", "--control", "r1", "--no-plots", "--quiet", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "Control arm: `r1`" in (tmp_path / "rep" / "report.md").read_text()


def test_unreadable_run_records_are_reported_not_a_crash(run_dir, tmp_path):
    runs = tmp_path / "runs"
    for name in ("good", "array", "truncated", "parts", "status"):
        shutil.copytree(run_dir, runs / name)
    (runs / "array" / "run_config.json").write_text("[]\n")
    (runs / "truncated" / "run_config.json").write_text("{")
    (runs / "truncated" / "status.json").unlink()  # the status is inferred, from the record it cannot read
    record = json.loads((runs / "parts" / "run_config.json").read_text())
    (runs / "parts" / "run_config.json").write_text(json.dumps({**record, "config": [], "data": 3}))
    (runs / "status" / "status.json").write_text('"finished"')
    result = _report(str(runs), "--no-plots", "--quiet", cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    md = (runs / "report.md").read_text()
    table = md.split("## Runs", 1)[1].split("\n## ", 1)[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "| finished |" in rows["good"]
    assert "finished (run_config.json unreadable: an array, not an object)" in rows["array"]
    assert "running (inferred; run_config.json unreadable: not valid JSON)" in rows["truncated"]
    assert (
        "run_config.json unreadable in part: `config` is an array, `data` is a number, not objects"
        in (rows["parts"])
    )
    assert "finished (inferred; status.json unreadable: a string, not an object)" in rows["status"]
    warning = next(line for line in md.splitlines() if "unreadable records" in line)
    assert warning.startswith("- **4 run(s) with unreadable records") and "good" not in warning
    assert "array: run_config.json unreadable" in warning and "truncated: run_config.json" in warning


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "the following arguments are required: paths"),
        (["runs", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, needle):
    """argparse's own errors (an unknown option, no path) as one line, not its usage block."""
    from trmoe.report.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"trmoe: report: {needle}; allowed: see python -m trmoe.report --help\n"
    )
    assert list(tmp_path.iterdir()) == []
