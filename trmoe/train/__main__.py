"""`python -m trmoe.train [overrides]` (also installed as `trmoe-train`): compose, validate, train.

Hydra composes the config from the groups in conf/; trmoe validates it and owns every file of the run
directory, so a bad config or input exits with one line and code 2, leaving nothing on disk.

In a sweep (--multirun, or an experiment=<grid>) a failed job does not stop the others: it leaves
<job dir>/status.json with its error line (the sweep report lists it as failed) and the process exits 1
after the last job; an Optuna search in which every trial failed too (its report written, one line naming
the trials, where the sweeper itself would end in a traceback).
"""

# ruff: noqa: E402  (the Ctrl-C handler of the start-up is installed before the slow imports)
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from pathlib import Path

INTERRUPTED_EARLY = "trmoe: interrupted before the run started; nothing was written"


def _interrupted_while_importing(_signum, _frame) -> None:
    """Ctrl-C while the modules below load (a second or more): nothing exists yet, so end at once with one
    line instead of an import traceback. main() puts the previous handler back before it composes."""
    print(INTERRUPTED_EARLY, file=sys.stderr)
    os._exit(130)


_previous_sigint = (
    signal.signal(signal.SIGINT, _interrupted_while_importing)
    if threading.current_thread() is threading.main_thread()
    else None
)

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import trmoe.config.schema  # noqa: F401  (registers the schemas before Hydra composes)
from trmoe.config.resolve import compose_error, to_config
from trmoe.errors import RunFailed, UserError
from trmoe.run import status, storage
from trmoe.run.rundir import named_by
from trmoe.run.signals import Preempted, hand_over

_task_started = False
_failed_jobs: list[str] = []  # sweep jobs of this process that failed (multirun)
_search: dict = {}  # an Optuna search's Hydra config, kept by its first failed trial


def _remove_empty_dirs(path: Path) -> None:
    """Undo the run directory (and its parents up to the launch directory) that Hydra created before the
    config was validated. rmdir only succeeds on empty directories: nothing a user wrote is ever removed."""
    cwd = Path.cwd().resolve()
    path = path.resolve()
    while path != cwd and cwd in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


class TrialFailed(Exception):
    """An Optuna trial whose job failed or whose objective is not finite: raised out of the job, so that the
    sweeper tells Optuna the trial FAILED (told as a value, NaN makes Optuna raise and the study die)."""


@hydra.main(version_base="1.3", config_path="pkg://trmoe.conf", config_name="config")
def _app(cfg: DictConfig) -> float:
    value = _job(cfg)
    hc = HydraConfig.get()
    if "optuna" in str(hc.sweeper.get("_target_", "")).lower() and not value == value:  # NaN: failed
        run_dir = Path(hc.runtime.output_dir)
        from trmoe.report.study import search_config

        _search.setdefault("hydra", search_config(hc, run_dir.parent))  # should every trial fail
        record = status.read_status(run_dir) or {}
        line = record.get("error") or "the objective (final held-out loss) is not finite: the trial diverged"
        if not record.get("error"):
            print(f"trmoe: sweep job {hc.job.num} failed: {line}", file=sys.stderr)
            _failed_jobs.append(f"{run_dir}: {line}")
        raise TrialFailed(f"trial {hc.job.num}: {line}")
    return value


def _job(cfg: DictConfig) -> float:
    global _task_started
    _task_started = True
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweeping = hc.mode == RunMode.MULTIRUN
    named_by("hydra.sweep.dir" if sweeping else "run.name")  # the key the advice names to choose another dir
    try:
        checked = to_config(cfg)  # a bad config is answered before the training stack (torch) is imported
        if checked.ladder.name is not None:  # a ladder's job: its stable run and a branch per budget
            from trmoe.train.ladder import train_ladder

            return train_ladder(cfg, run_dir, checked)
        from trmoe.train.loop import train

        return train(cfg, run_dir, checked)
    except Preempted as e:  # a stop signal: checkpoint saved; requeue (submitit) or exit 128 + signal
        print(f"trmoe: {e}", file=sys.stderr)
        hand_over(e)
    except KeyboardInterrupt:  # Ctrl-C outside the step loop, or twice: no traceback
        _remove_empty_dirs(run_dir)  # interrupted before it wrote anything
        print(_interrupted_line(run_dir), file=sys.stderr)
        sys.exit(130)
    except UserError as e:
        if sweeping:
            return _sweep_job_failed(run_dir, e)
        _remove_empty_dirs(run_dir)
        print(f"trmoe: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except RunFailed as e:  # fault guards or the final checkpoint: one line, exit 3
        if sweeping:
            return _sweep_job_failed(run_dir, e)
        print(f"trmoe: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:
        if sweeping:
            traceback.print_exc()
            return _sweep_job_failed(run_dir, e)
        raise
    finally:
        named_by("run.name")  # (a later train() in this process outside a sweep)
        # the process group of a torchrun/submitit job ends with the job (a basic-launcher sweep reuses
        # this process for the next one); only a job that got as far as loading the runtime can have one
        if "trmoe.runtime.distributed" in sys.modules:
            from trmoe.runtime import distributed

            distributed.shutdown()


def _interrupted_line(run_dir: Path) -> str:
    """What a Ctrl-C outside the step loop left: nothing, a run without a checkpoint, or one to resume."""
    from trmoe.run.rundir import RunDir

    if not run_dir.exists():
        return INTERRUPTED_EARLY
    checkpoints = RunDir(run_dir).checkpoints
    if checkpoints.is_dir() and any(not p.name.startswith(".") for p in checkpoints.iterdir()):
        return f"trmoe: interrupted; a rerun of {run_dir} resumes from its newest complete checkpoint"
    return f"trmoe: interrupted before the first checkpoint of {run_dir}; a rerun starts it from step 0"


def _is_composition_error(e: BaseException) -> bool:
    """A config that cannot be composed (Hydra's and OmegaConf's exceptions, and the ValueError of Hydra's
    defaults list for a group override it cannot take, e.g. `hydra/launcher=5`), as opposed to a failure of
    the job itself, which keeps its traceback."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # (yaml: a broken file under --config-dir)
    return isinstance(e, HydraException | OmegaConfBaseException | ValueError | yaml.YAMLError)


def _sweep_job_failed(run_dir: Path, exc: BaseException) -> float:
    """A failed sweep job must not stop the others, and Hydra's basic sweeper skips on_multirun_end (the
    report) once any job has raised. So the failure goes on disk (status.json, which the report lists with
    its error line), the job returns NaN, and main() exits 1 after the sweep."""
    hc = HydraConfig.get()
    line = status.error_line(exc)
    if status.read_status(run_dir) is None:  # failed before the loop created the run's records (bad config)
        run_dir.mkdir(parents=True, exist_ok=True)
        status.write_status(run_dir, status.FAILED, error=line, overrides=list(hc.overrides.task))
    # a refusal's diff and advice follow its first line (status.json and the summary keep that line only)
    said = str(exc).strip() if isinstance(exc, UserError) and str(exc).strip() else line
    print(f"trmoe: sweep job {hc.job.num} failed: {said}", file=sys.stderr)
    _failed_jobs.append(f"{run_dir}: {line}")
    return float("nan")


def _no_trial_left(e: Exception) -> bool:
    """An Optuna search in which every trial failed (the sweeper's ValueError from `study.best_trial`): its
    report and one line naming the trials (trmoe.report.callback.report_failed_search); exit 1, as any sweep
    with a failed job."""
    from trmoe.report.callback import report_failed_search

    if "hydra" not in _search or not _failed_jobs or "No trials are completed" not in str(e):
        return False
    report_failed_search(_search["hydra"], [Path(job.split(": ", 1)[0]).name for job in _failed_jobs])
    return True


def _precheck(argv: list[str]) -> None:
    """What can be refused before Hydra writes anything: its command line, parsed as Hydra parses it but with
    one-line errors (Hydra prints its usage block); a group given more than one option; and every job of a
    sweep, which must compose, and not be invalid all together (Hydra writes multirun.yaml first, the jobs'
    configs one by one later). A single run's composition errors come before any write."""
    from trmoe.cli import Parser
    from trmoe.config.hydra_adapter import args_parser
    from trmoe.config.resolve import check_group_overrides
    from trmoe.config.sweep import check_jobs, sweep_jobs

    args = Parser(prog="python -m trmoe.train", parents=[args_parser()], add_help=False).parse_args(argv)
    _check_equals(args.overrides)
    if args.config_dir or args.config_path or args.config_name or args.shell_completion:
        return  # another config tree than the packaged one: Hydra composes it (and reports its errors)
    check_group_overrides(args.overrides)
    if args.help or args.hydra_help or args.cfg or args.info or args.run:
        return
    switches = ("experiment=", "hparams_search=")
    if not args.multirun and not any(o.startswith(switches) for o in args.overrides):
        return  # only a grid (experiment=...) or a search switches to a sweep by itself
    jobs, multirun = sweep_jobs(args.overrides, cli_multirun=args.multirun)
    if args.multirun or multirun:
        check_jobs(jobs, pick_device=_pick_device, wall_time=_wall_time)


def _pick_device(name: str, *, label: str):
    """trmoe.runtime.env.pick_device, imported (with torch) only when a job names a device to look for."""
    from trmoe.runtime.env import pick_device

    return pick_device(name, label=label)


def _wall_time(cfg) -> None:
    """trmoe.plan.walltime.check_config (torch): a job estimated above trainer.max_hours on a CPU."""
    from trmoe.plan.walltime import check_config

    check_config(cfg)


def _check_equals(overrides: list[str]) -> None:
    """`trainer.steps 10`: Hydra says it cannot parse `trainer.steps`; the `=` is what is missing, and the
    next word is the value meant."""
    from trmoe.config.resolve import missing_equals

    for i, word in enumerate(overrides):
        if "=" in word or word.startswith("~"):  # an override, or a deletion (`~key`)
            continue
        following = overrides[i + 1] if i + 1 < len(overrides) and "=" not in overrides[i + 1] else None
        raise UserError(f"config error: {missing_equals(word, following)}")


def main(argv: list[str] | None = None) -> int:
    """The exit code of `python -m trmoe.train <argv>` (sys.argv[1:] when argv is None), run in this process.
    Hydra reads sys.argv itself: an argv given here stands in for it during the call."""
    from trmoe.cli import run

    return run(_main, argv)


def _main(argv: list[str]) -> int:
    global _task_started
    if _previous_sigint is not None and signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
        signal.signal(signal.SIGINT, _previous_sigint)  # from here on Ctrl-C is a KeyboardInterrupt
    _task_started = False
    _failed_jobs.clear()
    _search.clear()
    saved = sys.argv
    sys.argv = [saved[0] if saved else "trmoe.train", *argv]
    try:
        return _compose_and_run(argv)
    except KeyboardInterrupt:  # while composing, before the job started: nothing was written
        print(INTERRUPTED_EARLY, file=sys.stderr)
        return 130
    finally:
        sys.argv = saved


def _compose_and_run(argv: list[str]) -> int:
    # Hydra prints its composition errors (unknown key, bad value, missing group option, bad syntax) over
    # several lines and exits 1. Told to raise them instead, it leaves the reporting to trmoe: one line, 2.
    user_asked = os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        _precheck(argv)
    except UserError:
        raise
    except Exception:  # an override that does not parse, a sweep the check cannot expand (glob()): Hydra
        pass  # composes them and reports its errors below
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _app()
    except SystemExit as e:
        if e.code == 1 and not _task_started:  # Hydra's own argument errors
            return 2
        raise
    except Exception as e:
        if _no_trial_left(e):
            return 1
        if user_asked or _task_started:  # a failure of the job itself keeps its traceback
            raise
        if _is_composition_error(e):  # before OSError: Hydra's missing-option error is an IOError too
            print(f"trmoe: {compose_error(e)}", file=sys.stderr)
            return 2
        if isinstance(e, BrokenPipeError):  # `--help | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # 128 + SIGPIPE, as a shell reports it
        if isinstance(e, OSError) and e.filename is not None:  # Hydra making the run or sweep directory:
            # read-only or full is exit 3 as at any later write, a file in the way 2 (trmoe.run.storage)
            error = storage.cannot_create(e, Path(str(e.filename)))
            print(f"trmoe: {error}", file=sys.stderr)
            return error.exit_code
        raise
    finally:
        if not user_asked:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    if _failed_jobs:
        print(f"trmoe: {len(_failed_jobs)} sweep job(s) failed:", *_failed_jobs, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
