"""docs/scaling.md's worked ladder excerpt, regenerated from the real commands so that it cannot drift.

The doc holds a marked block (`<!-- excerpt:ladder_smoke begin -->` ... `end -->`): first a fenced block of
the commands (the train sweep, then the report of its sweep directory), then a fenced block of the excerpt of
the report.md they write (`excerpt`: its Scaling section from the runs left out to the backtest, no timing in
it). The test runs those commands, as written, in real child processes and asserts that the doc's excerpt is
what they printed; with TRMOE_REGEN_DOCS=1 it rewrites the doc's excerpt instead. Changing the ladder (e.g.
to a CPU ladder) is a change of the command line in the doc and one regenerating run.

Deterministic on CPU: one thread (hardware.threads=1), seeded data order, initialisation and bootstrap; the
excerpt's figures are rounded to 3-4 digits by the report."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scaling.md"
BEGIN, END = "<!-- excerpt:ladder_smoke begin", "<!-- excerpt:ladder_smoke end -->"
FENCE = re.compile(r"^```\n(.*?)^```\n", re.S | re.M)


def _block(text: str) -> tuple[int, int, list[str]]:
    """(start, end) of the marked block's text in the doc, and its two fenced blocks' contents."""
    start = text.index(BEGIN)
    end = text.index(END, start)
    fences = FENCE.findall(text, start, end)
    assert len(fences) == 2, "the marked block holds two fenced blocks: the commands, then the excerpt"
    return start, end, fences


def commands(text: str) -> list[list[str]]:
    """The block's commands (its first fenced block: one command a line, backslash continuations joined,
    comments dropped)."""
    lines = _block(text)[2][0].replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip() and not line.startswith("#")]


def excerpt(report_md: str) -> str:
    """The excerpt of a ladder report: its Scaling section from the runs left out of the fits (or the
    first table) to the backtest's table included (what the fits, multipliers and backtest printed)."""
    section = report_md.split("\n## Scaling\n", 1)[1]
    start = min(i for i in (section.find("Left out of the fits"), section.find("### ")) if i >= 0)
    body = section[start:].split("\n### Downstream", 1)[0]
    return body.strip() + "\n"


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_worked_ladder_excerpt_is_what_its_commands_print(tmp_path):
    """Run the doc's commands (python = this interpreter) from an empty folder; the doc's excerpt equals the
    report's. TRMOE_REGEN_DOCS=1: rewrite the doc's excerpt from this run instead."""
    import subprocess

    text = DOC.read_text()
    argvs = commands(text)
    assert [a[:3] for a in argvs] == [["python", "-m", "trmoe.train"], ["python", "-m", "trmoe.report"]]
    try:
        for argv in argvs:
            result = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=child_env(),
                                    capture_output=True, text=True, timeout=3600)  # fmt: skip
            assert result.returncode == 0, (argv, result.stderr[-3000:])
        sweep = tmp_path / argvs[1][3]
        got = excerpt((sweep / "report.md").read_text())
    finally:  # the stable runs' checkpoints: gigabytes (the o200k embedding's Adam moments)
        shutil.rmtree(tmp_path / "multirun", ignore_errors=True)
    start, end, (_, doc_excerpt) = _block(text)
    if os.environ.get("TRMOE_REGEN_DOCS"):
        block = text[start:end]
        block = block[: block.rindex("```\n", 0, block.rindex("```\n"))] + "```\n" + got + "```\n"
        DOC.write_text(text[:start] + block + text[end:])
        return
    assert doc_excerpt == got, "docs/scaling.md's excerpt differs: TRMOE_REGEN_DOCS=1 rewrites it"
