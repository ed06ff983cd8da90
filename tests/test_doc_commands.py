"""Every shell command printed in README.md and docs/*.md, checked by what it takes to run it, so that a doc
example cannot rot.

The commands are read from the fenced blocks (```, ```bash, ```sh) as a shell reads them: a line that starts
with a program, backslash continuations joined, quotes spanning lines kept (a newline inside a quote reaches
the program, as it would from a shell), comments dropped. A block whose first line is `# <path>` and that
holds no command is a file the docs ask for (myconf/pilot.yaml): it is written where it says, and block
diagrams (box-drawing characters) are not commands. Each command is then, by kind, in one process and
without training:

- `python -m trmoe.train` / `trmoe-train` (and under `srun`): every job of it composed and validated as the
  app does before it trains (Hydra's grammar, the sweep's expansion, the group options, every key's checks,
  the parameter match); `--help` and `--cfg` run as they are.
- `trmoe.data.prepare`, `trmoe.plan`, `trmoe.match`: run for real on tiny inputs (the docs' corpus is three
  short files here).
- the tools that read a finished run or measure (`sample`, `export`, `eval`, `trmoe-lm-eval`, `report`,
  `convert`, `bench`): every option of the command is one the tool's `--help` lists (their tests run them on
  real runs: test_sample, test_export, test_eval, test_report_cli, test_convert, test_bench).
- `make <target>`: `make -n` knows the target; `pip install -e ".[x]"`: each extra is in pyproject.toml;
  `bash <script>`: the script exists and parses (`bash -n`).

What cannot run here is listed in SKIPPED with its reason; anything else unknown fails the test. A
documented sweep of arms (`arm=`, `routing=`) must compare models of one parameter count, or be its grid's
parameter match off only by the reported residual.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("python ", "trmoe-", "make ", "pip ", "tensorboard ", "srun ", "bash ", "rc=")
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

# (file, start of the command) -> why it is not run here
SKIPPED = {
    ("README.md", "tensorboard"): "a long-running viewer (server), not a trmoe command",
    ("docs/reliability.md", "rc="): "shell bookkeeping of a SLURM batch script (scontrol requeue)",
    (
        "docs/data.md",
        "python -m trmoe.data.prepare INPUT",
    ): "a synopsis (INPUT, DIR, [optional]), not an example",
    ("docs/data.md", "python -m trmoe.data.prepare verify DIR"): "a synopsis (DIR [DIR ...]), not an example",
    ("docs/data.md", "python -m trmoe.data.prepare --embedded --out DIR"): "a synopsis ([options]), not an "
    "example",
    ("docs/data.md", "python -m trmoe.train data=mixture data.sources.web.weight"): "a fragment (`...`): "
    "one key changed on top of the mixture above",
    ("docs/after_training.md", "python -m trmoe.train ..."): "a fragment (`...`): keys added to a run",
    (
        "docs/routing.md",
        "python -m trmoe.train routing=distilled",
    ): "reads the parent run the line above it trains (tests/test_distilled.py runs the pair)",
    ("docs/extending.md", "pip install ./trmoe-demo-plugins"): "installs the demo plug-in package: "
    "tests/test_plugins.py installs it (into a temporary folder) and trains the selection below",
    ("docs/extending.md", "python -m trmoe.train optimizer=demo_signum"): "needs the demo plug-in "
    "installed: tests/test_plugins.py trains this selection with it",
}


@dataclass(frozen=True)
class Command:
    file: str
    line: int
    text: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def _blocks(path: Path):
    text = path.read_text()
    for m in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M):
        if m.group(1) in ("", "bash", "sh", "shell"):
            yield text[: m.start(2)].count("\n") + 1, m.group(2)


def _commands_in(path: Path) -> tuple[list[Command], dict[str, str]]:
    """(the commands, the files {path: content}) of one document."""
    commands, files = [], {}
    name = str(path.relative_to(ROOT))
    for first, body in _blocks(path):
        if any(c in body for c in "│└├"):
            continue  # a diagram
        lines = body.splitlines()
        header = re.fullmatch(r"#\s*(\S+\.(?:yaml|yml|txt))", lines[0].strip()) if lines else None
        if header and not any(line.lstrip().startswith(PROGRAMS) for line in lines):
            files[header.group(1)] = body
            continue
        i = 0
        while i < len(lines):
            if not lines[i].lstrip().startswith(PROGRAMS):
                i += 1
                continue
            start, text = i, lines[i]
            while True:
                joined = text.replace("\\\n", "")  # the shell drops a backslash-newline
                try:
                    if joined.rstrip().endswith("\\"):
                        raise ValueError("continued")
                    argv = shlex.split(joined, comments=True)
                    break
                except ValueError:  # an open quote or a trailing backslash: the next line belongs to it
                    i += 1
                    assert i < len(lines), f"{name}:{first + start}: the command never ends"
                    text += "\n" + lines[i]
            commands.append(Command(name, first + start, joined.split("#")[0].strip(), tuple(argv)))
            i += 1
    return commands, files


def _all() -> tuple[list[Command], dict[str, str]]:
    commands, files = [], {}
    for path in DOCS:
        found, written = _commands_in(path)
        commands += found
        files.update(written)
    return commands, files


COMMANDS, FILES = _all()


def _skip_reason(command: Command) -> str | None:
    return next(
        (
            why
            for (file, start), why in SKIPPED.items()
            if command.file == file and command.text.startswith(start)
        ),
        None,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The working directory the docs assume: a text corpus (corpus.txt, corpus/, code.txt) and the files
    the docs print (myconf/pilot.yaml)."""
    root = tmp_path_factory.mktemp("docs")
    text = "\n\n".join(
        f"Document {i}: the model reads a window of tokens and predicts the next." for i in range(40)
    )
    (root / "corpus.txt").write_text(text)
    (root / "code.txt").write_text(text)
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"part{i}.txt").write_text(text)
    for name, content in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return root


def _module(argv: tuple[str, ...]) -> tuple[str, list[str]]:
    """(the module a command runs, its arguments): `python -m <module>`, a console script, or under srun."""
    if argv[0] == "srun":
        argv = argv[1:]
    if argv[:2] == ("python", "-m"):
        return argv[2], list(argv[3:])
    if argv[0] in SCRIPTS:
        return SCRIPTS[argv[0]].split(":")[0], list(argv[1:])
    raise AssertionError(f"no rule for {' '.join(argv)}")


def _validate_train(args: list[str], cwd: Path) -> None:
    """Every job of the command composed and validated as the train app does before it trains."""
    from hydra import compose, initialize_config_dir

    from trmoe.config.hydra_adapter import args_parser, expand_sweep, parse_overrides
    from trmoe.config.resolve import compose_packaged, to_config
    from trmoe.config.sweep import sweep_jobs

    parsed = args_parser().parse_args(args)
    overrides = list(parsed.overrides)
    if parsed.config_dir:  # the user's folder first, the packaged tree behind it (as the app searches)
        jobs = expand_sweep(parse_overrides(overrides))
        with initialize_config_dir(str(cwd / parsed.config_dir), version_base="1.3"):
            for job in jobs:
                to_config(
                    compose(parsed.config_name, overrides=[*job, "hydra.searchpath=[pkg://trmoe.conf]"])
                )
        return
    if any(o.startswith("hparams_search=") for o in overrides):  # Optuna draws the jobs: the base config
        cfg = compose_packaged(overrides, hydra_node=True)
        assert cfg.hydra.sweeper.n_trials >= 1
        to_config(compose_packaged([o for o in overrides if not o.startswith("hydra.")]))
        return
    jobs, _ = sweep_jobs(overrides, cli_multirun=parsed.multirun)
    for job in _each_value_once(jobs):
        job = tuple(o for o in job if not o.startswith("hydra."))
        if job not in _VALID:  # the docs repeat jobs (the smoke grid three times)
            to_config(compose_packaged(list(job)))
            _VALID.add(job)


_VALID: set[tuple[str, ...]] = set()


def _each_value_once(jobs: list[list[str]]) -> list[list[str]]:
    """The jobs of a sweep that together take every value of every swept key (the first job, then each job
    that differs from it in one key only): a value that does not compose or validate is found at the cost of
    the sum of the value counts, not their product (routing ablation x 3 seeds: 13 jobs, not 33)."""
    first = jobs[0]
    return [first] + [job for job in jobs[1:] if sum(a != b for a, b in zip(job, first, strict=True)) == 1]


def _options_known(module: str, args: list[str], cwd: Path) -> None:
    """Every --option of the command is one the tool's --help lists (bench: the named benchmark's)."""
    helps = [*args[:1], "--help"] if module == "trmoe.bench" else ["--help"]
    if module == "trmoe.eval":  # Hydra-composed: its keys are the schema's
        from trmoe.config.schema import EvalToolConfig

        keys = {f for f in EvalToolConfig.__dataclass_fields__}
        for arg in args:
            assert arg.partition("=")[0] in keys, f"{arg}: not a key of python -m trmoe.eval ({sorted(keys)})"
        return
    if module == "trmoe.eval.harness":  # the harness's own parser (its --help is the same)
        from lm_eval._cli import HarnessCLI

        saved, sys.argv = sys.argv, ["lm_eval", "run", *args]
        try:
            HarnessCLI().parse_args()
        finally:
            sys.argv = saved
        return
    result = cli(helps, cwd=cwd, module=module)
    assert result.returncode == 0, result.stderr
    for arg in args:
        if arg.startswith("--"):
            assert arg.split("=")[0] in result.stdout, f"{arg}: not an option of {module} ({' '.join(helps)})"


@contextlib.contextmanager
def _cwd(path: Path):
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def check(command: Command, cwd: Path) -> str:
    """Check one command; what was done."""
    argv = command.argv
    if argv[0] == "make":
        done = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return "make -n"
    if argv[0] == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in argv[2:]:
            for extra in re.findall(r"\[([^\]]+)\]", spec):
                assert set(extra.split(",")) <= set(extras), f"{spec}: extras {sorted(extras)}"
        return "extras exist"
    if argv[0] == "bash":
        assert (ROOT / argv[1]).is_file() and subprocess.run(
            ["bash", "-n", str(ROOT / argv[1])]
        ).returncode == 0
        return "bash -n"
    module, args = _module(argv)
    if module == "trmoe.train":
        if {"--help", "--cfg"} & set(args):
            result = cli(args, cwd=cwd)
            assert result.returncode == 0, result.stderr
            return "ran"
        _validate_train(args, cwd)
        return "validated"
    if module in ("trmoe.data.prepare", "trmoe.plan", "trmoe.match"):
        result = cli(
            [*args, "--workers", "0"] if module == "trmoe.data.prepare" else args, cwd=cwd, module=module
        )
        assert result.returncode == 0, result.stderr
        return "ran"
    _options_known(module, args, cwd)
    return "options known"


def test_every_documented_command(world):
    """Every command of the docs in order, one working directory (a dataset prepared by one command is read
    by the next); the skipped ones name their reason."""
    assert len(COMMANDS) > 60, "the commands were not found"
    failures, done = [], {}
    for command in COMMANDS:
        why = _skip_reason(command)
        if why is not None:
            done[str(command)] = f"skipped: {why}"
            continue
        start = time.perf_counter()
        try:
            with _cwd(world):
                done[str(command)] = f"{check(command, world)} ({time.perf_counter() - start:.2f} s)"
        except BaseException as e:  # noqa: BLE001  (every failure listed, not the first alone)
            failures.append(f"{command}\n    {type(e).__name__}: {str(e).strip()[:400]}")
    print("\n".join(f"{k} -> {v}" for k, v in done.items()))
    assert not failures, f"{len(failures)} documented command(s) fail:\n" + "\n".join(failures)
    assert set(SKIPPED) <= {
        (c.file, start)
        for c in COMMANDS
        for (f, start) in SKIPPED
        if c.file == f and c.text.startswith(start)
    }, "a SKIPPED entry matches no command: drop it"


def test_the_docs_state_the_sweep_layout_and_trial_count_the_config_has():
    """multirun/README.md's folder layout is hydra.sweep.dir's (a date, a time and a random suffix), its
    submitit log folder the launcher's, and the README's Optuna comment counts the preset's trials."""
    from omegaconf import OmegaConf

    from trmoe.config.resolve import compose_packaged

    layout = (ROOT / "multirun" / "README.md").read_text()
    hydra = compose_packaged([], hydra_node=True).hydra
    assert OmegaConf.to_container(hydra.sweep)["dir"] == "multirun/${now:%Y-%m-%d}/${trmoe.stamp:%H-%M-%S}"
    assert "`multirun/<date>/<time>-<random>/<job number>/`" in layout  # trmoe.stamp adds the suffix
    launcher = compose_packaged(["hydra/launcher=submitit_local"], hydra_node=True).hydra.launcher
    assert OmegaConf.to_container(launcher)["submitit_folder"] == "${hydra.sweep.dir}/.submitit/%j"
    assert "`<sweep dir>/.submitit/<job id>/`" in layout
    trials = compose_packaged(["hparams_search=lr_warmup"], hydra_node=True).hydra.sweeper.n_trials
    readme = (ROOT / "README.md").read_text()
    assert f"{trials} trials by default" in readme


COMPARED = ("arm=", "routing=", "routing.strategy=")  # a sweep over these compares its values as arms


def _compared_groups(command: Command) -> list[list[list[str]]]:
    """A documented training sweep's jobs that a report compares as arms of one another: the same overrides
    but for the compared keys (and the seed). Nothing when the command sweeps none of them."""
    from trmoe.config.hydra_adapter import args_parser
    from trmoe.config.sweep import sweep_jobs

    try:
        module, args = _module(command.argv)
    except AssertionError:  # not a python program (make, pip, bash, ...)
        return []
    if module != "trmoe.train" or "--help" in args or "--cfg" in args:
        return []
    parsed = args_parser().parse_args(args)
    if parsed.config_dir or any(o.startswith("hparams_search=") for o in parsed.overrides):
        return []
    jobs, _ = sweep_jobs(list(parsed.overrides), cli_multirun=parsed.multirun)
    groups: dict[tuple[str, ...], list[list[str]]] = {}
    for job in jobs:
        job = [o for o in job if not o.startswith("hydra.")]
        rest = tuple(o for o in job if not o.startswith((*COMPARED, "trainer.seed=")))
        groups.setdefault(rest, []).append(job)
    return [g for g in groups.values() if len({tuple(o for o in j if o.startswith(COMPARED)) for j in g}) > 1]


def test_every_documented_comparison_is_of_matched_models(world):
    """A documented sweep whose arms a report compares trains models of one parameter count, or each arm is
    its grid's parameter match (one `model.match_params`) off only by the match's residual, which the run
    records and the report names (the learned router's L x E x H parameters, docs/experiments.md). Old docs:
    after_training.md's downstream sweep without its grid, 12,899,904 against 12,924,484 parameters and no
    match at all. Counts from each job's composed config (the model on the meta device)."""
    from trmoe.config.param_match import solve_match
    from trmoe.config.resolve import compose_packaged, to_config
    from trmoe.config.spec import model_spec
    from trmoe.model.transformer import parameter_counts

    unmatched, checked = [], 0
    for command in COMMANDS:
        if _skip_reason(command) is not None:
            continue
        with _cwd(world):
            groups = _compared_groups(command)
        for group in groups:
            counts, solutions = {}, {}
            for job in group:
                arm = " ".join(o for o in job if o.startswith(COMPARED))
                if arm not in counts:
                    with _cwd(world):
                        cfg = to_config(compose_packaged(job))
                    counts[arm], solutions[arm] = parameter_counts(model_spec(cfg)).total, solve_match(cfg)
            checked += 1
            targets = {s.target if s else None for s in solutions.values()}
            residuals_only = (
                None not in targets
                and len(targets) == 1
                and all(abs(s.residual) < 1e-3 * s.target for s in solutions.values())
            )
            if len(set(counts.values())) > 1 and not residuals_only:
                unmatched.append(f"{command}\n    {counts}")
    assert checked >= 3, "no documented comparison was found"
    assert not unmatched, "documented comparisons of unmatched models:\n" + "\n".join(unmatched)
