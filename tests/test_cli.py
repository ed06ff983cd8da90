"""trmoe.cli.run, the one wrapper of every entry point: a UserError is one line on stderr and exit code 2, a
RunFailed 3, a SystemExit its own code; and the same line and code from a real process, once per kind of
command line (the Hydra train app, a Hydra-composed tool, argparse tools). Every other bad-input case calls
its tool's main(argv) in-process (helpers.cli)."""

from __future__ import annotations

import pytest
from helpers import cli, run_cli

from trmoe.cli import Parser, run
from trmoe.errors import RunFailed, UserError


def _raise(error: BaseException):
    def main(argv: list[str]) -> None:
        raise error

    return main


@pytest.mark.parametrize(
    ("main", "code", "err"),
    [
        (lambda argv: None, 0, ""),
        (lambda argv: 5, 5, ""),
        (lambda argv: ["a result"], 0, ""),  # a tool's main may return what it made
        (_raise(UserError("x: bad; allowed: y")), 2, "trmoe: x: bad; allowed: y\n"),
        (_raise(RunFailed("guards tripped")), 3, "trmoe: guards tripped\n"),
        (_raise(SystemExit(0)), 0, ""),  # --help
        (_raise(SystemExit(143)), 143, ""),  # a signal's 128 + n
        (_raise(SystemExit("stopped")), 1, "stopped\n"),  # as the interpreter prints it
    ],
)
def test_run_turns_every_ending_into_an_exit_code(main, code, err, capsys):
    assert run(main, []) == code
    captured = capsys.readouterr()
    assert captured.err == err and captured.out == ""


def test_run_reads_sys_argv_when_given_none_and_keeps_a_bug_s_traceback(monkeypatch):
    monkeypatch.setattr("sys.argv", ["tool", "a", "b"])
    seen = []
    assert run(seen.append) == 0 and seen == [["a", "b"]]
    with pytest.raises(ZeroDivisionError):
        run(lambda argv: 1 / 0, [])


def test_a_parser_error_is_one_line_naming_the_tool(capsys):
    parser = Parser(prog="python -m trmoe.thing")
    parser.add_argument("--n", type=int)
    assert run(parser.parse_args, ["--n", "x"]) == 2
    assert capsys.readouterr().err == (
        "trmoe: thing: argument --n: invalid int value: 'x'; allowed: see python -m trmoe.thing --help\n"
    )


# One bad input per kind of command line, as a user runs it: the same line and code in a fresh process as
# main(argv) gives in-process (the console path: `python -m`, sys.exit(main()), nothing written).
KINDS = [
    ("trmoe.train", ["model.hiden_size=8"], "trmoe: config error: model.hiden_size: model has no such key"),
    ("trmoe.eval", ["run=nope", "tasks=[arc_easy]"], "trmoe: run nope: no such file or directory"),
    ("trmoe.report", ["nope"], "trmoe: report: not a directory: nope"),
    ("trmoe.data.prepare", ["nope.txt", "--out", "ds"], "nope.txt: no such file or directory"),
]


@pytest.mark.subprocess
@pytest.mark.parametrize(("module", "args", "line"), KINDS, ids=[k[0] for k in KINDS])
def test_a_real_process_gives_the_line_and_code_main_gives(module, args, line, tmp_path):
    for where in ("real", "inner"):
        (tmp_path / where).mkdir()
    real = run_cli(args, tmp_path / "real", timeout=300, module=module)
    inner = cli(args, tmp_path / "inner", module=module)
    assert real.returncode == inner.returncode == 2, real.stderr[-2000:]
    assert real.stderr.replace(str(tmp_path / "real"), str(tmp_path / "inner")) == inner.stderr
    assert real.stderr.startswith("trmoe: ") and line in real.stderr, real.stderr
    assert len(real.stderr.splitlines()) == 1 and real.stdout == inner.stdout == ""
    assert sorted(tmp_path.rglob("*")) == [tmp_path / "inner", tmp_path / "real"]  # nothing written


def _console_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: console script -> `module:function`."""
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["scripts"]


@pytest.mark.parametrize("script", sorted(_console_scripts()))
def test_every_console_tool_has_version(script, capsys):
    """`trmoe-eval --version` was a Hydra lexer error, `trmoe-sample --version` an unknown argument: only
    trmoe-train had it."""
    import importlib
    from importlib.metadata import version

    module, function = _console_scripts()[script].split(":")
    main = getattr(importlib.import_module(module), function)
    assert main(["--version"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"trmoe {version('trmoe')} (torch {version('torch')}, hydra-core ")
    assert not out.err


@pytest.mark.subprocess
def test_a_console_script_is_named_as_typed(tmp_path):
    """A bad option of `trmoe-sample` (a console script: sys.argv[0] ends in trmoe-sample) names
    `trmoe-sample`, which the user typed, not `python -m trmoe.sample`; `python -m` keeps its name."""
    from helpers import python

    script = tmp_path / "bin" / "trmoe-sample"  # what pip writes for [project.scripts]
    script.parent.mkdir()
    script.write_text("import sys\nfrom trmoe.sample import main\nsys.exit(main())\n")
    typed = python(script, "runs/x", "--max-new-tokens", "abc", cwd=tmp_path)
    assert typed.returncode == 2 and typed.stderr == (
        "trmoe: trmoe-sample: argument --max-new-tokens: invalid int value: 'abc'; "
        "allowed: see trmoe-sample --help\n"
    )
    module = python("-m", "trmoe.sample", "runs/x", "--max-new-tokens", "abc", cwd=tmp_path)
    assert module.returncode == 2 and "allowed: see python -m trmoe.sample --help" in module.stderr
