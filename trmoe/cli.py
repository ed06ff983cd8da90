"""The command lines of trmoe's tools: bad input is one line on stderr and exit code 2, like every other user
error, instead of argparse's usage block. Kept free of torch so that parsing stays instant.

Every entry point is `main(argv: list[str] | None = None) -> int`, `return run(_main, argv)`: the one place
that turns a UserError (exit code 2) or a RunFailed (3) into its line on stderr, so that a tool, a console
script and a test calling `main([...])` in-process see the same exit code and the same line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from trmoe.errors import RunFailed, UserError
from trmoe.registry import field_comments


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a SLURM allocation): what hardware.threads
    and trmoe.data.prepare --workers are bounded by."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def versions() -> str:
    """`--version` of every tool: trmoe's, torch's and Hydra's (read from the installed packages: torch is
    not imported)."""
    from importlib.metadata import version

    return f"trmoe {version('trmoe')} (torch {version('torch')}, hydra-core {version('hydra-core')})"


def typed_prog(prog: str) -> str:
    """`prog` ("python -m trmoe.<module> [command]") as the user typed it: a console script (`trmoe-sample`,
    sys.argv[0]) names itself, so that a message's "see <prog> --help" is a command the user can run."""
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not script.startswith("trmoe-") or not prog.startswith("python -m trmoe."):
        return prog
    command = prog.split(" ", 3)[3:]  # a subcommand after the module (`python -m trmoe.bench step`)
    return " ".join([script, *command])


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors raise UserError ("<tool>: <error>; allowed: see <prog> --help"), which
    the tool prints as one line (exit code 2) before it does any work. Its prog is written as
    `python -m trmoe.<module>` and shown as the user typed it (typed_prog)."""

    def __init__(self, *args, prog: str | None = None, **kwargs) -> None:
        super().__init__(*args, prog=typed_prog(prog) if prog else None, **kwargs)

    def error(self, message: str) -> NoReturn:
        if "allowed" not in message and "choose from" not in message:
            message += f"; allowed: see {self.prog} --help"
        raise UserError(f"{self.prog.removeprefix('python -m trmoe.')}: {message}")


def fail(error: UserError | RunFailed) -> int:
    """`error` as its one line on stderr ("trmoe: <message>"); its exit code."""
    print(f"trmoe: {error}", file=sys.stderr)
    return error.exit_code


def exit_code(code: object) -> int:
    """The exit status a SystemExit(code) gives the process: None is 0, a number itself, anything else (a
    message) is printed on stderr and is 1, as the interpreter does it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run(main: Callable[[list[str]], object], argv: Sequence[str] | None = None) -> int:
    """The exit code of a tool's `main(argv)` (sys.argv[1:] when argv is None): the int it returns (0 when
    it returns anything else, e.g. its result);
    a UserError or RunFailed as one line on stderr and its code; a SystemExit (--help, a signal's 128 + n)
    as its code. Anything else is a bug and keeps its traceback. `--version` prints `versions()`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--version" in args:  # every tool's, before its own parser (Hydra's flag prints Hydra's version only)
        print(versions())
        return 0
    try:
        code = main(args)
    except (UserError, RunFailed) as e:
        return fail(e)
    except SystemExit as e:
        return exit_code(e.code)
    return code if isinstance(code, int) else 0


def keys_help(cls: type) -> str:
    """A Hydra-composed tool's keys as its --help lists them: `key=<default>  comment`, one a line."""
    comments = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        value = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        shown = "(required)" if value in (dataclasses.MISSING, "???") else "null" if value is None else value
        rows.append((f"{f.name}={shown}", comments.get(f.name, "")))
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"  {key:<{width}}  {doc}".rstrip() for key, doc in rows)
