"""The jobs of a sweep, as Hydra's basic sweeper will launch them, known before anything is launched.

A sweep's jobs are every combination of the grid's `hydra.sweeper.params` (from `experiment=<name>`) and
of the comma-separated sweep overrides on the command line (`attention=gqa,mha`). `trmoe.match` solves each
of them; the train app composes and validates each before Hydra writes the sweep directory, so a misspelt
value in the third job, or a setting no job can run with, stops the launch with one line instead of after two
jobs and a multirun.yaml.
"""

from __future__ import annotations

from collections.abc import Callable

from hydra.types import RunMode

from trmoe.config.hydra_adapter import expand_sweep, parse_overrides
from trmoe.config.resolve import check_group_overrides, compose_error, compose_packaged, to_config
from trmoe.errors import UserError


def sweep_jobs(overrides: list[str], cli_multirun: bool = False) -> tuple[list[list[str]], bool]:
    """(every job's override list in launch order, whether the composed config is a multirun); a multirun
    (`cli_multirun`: --multirun was given) is refused a launcher this machine cannot run."""
    try:
        parsed = parse_overrides(overrides)
    except Exception as e:  # Hydra's parse errors
        raise UserError(compose_error(e)) from None
    cfg = compose_packaged([o.input_line for o in parsed if not o.is_sweep_override()], hydra_node=True)
    params = cfg.hydra.sweeper.params or {}
    lines = [f"{k}={v}" for k, v in params.items()] + list(overrides)
    multirun = cfg.hydra.mode == RunMode.MULTIRUN
    if multirun or cli_multirun:
        check_launcher(cfg)
    return expand_sweep(parse_overrides(lines)), multirun


def check_launcher(cfg) -> None:
    """The SLURM launcher needs SLURM's commands on this machine (submitit looks for `srun`): without them
    its sweep would fail after Hydra wrote the sweep directory, with a traceback."""
    import shutil

    target = str(cfg.hydra.launcher.get("_target_", ""))
    if "SlurmLauncher" in target and shutil.which("srun") is None:
        raise UserError(
            f"config error: hydra.launcher={target.rsplit('.', 1)[-1]} (hydra/launcher=submitit_slurm, or a "
            "slurm_* hardware preset): no SLURM on this machine (srun not found); allowed here: the basic "
            "launcher (drop the override) or hydra/launcher=submitit_local"
        )


def check_jobs(
    jobs: list[list[str]],
    pick_device: Callable[..., object] | None = None,
    wall_time: Callable[[object], object] | None = None,
) -> None:
    """Compose and validate every job's config before Hydra writes anything. A job that does not compose
    raises a one-line UserError naming its overrides. One that composes but is invalid fails on its own (the
    other jobs run, as documented), unless every job is invalid: then nothing could run, and the sweep is
    refused in one line naming the jobs, as a single run would be (`hardware=cuda` on a CPU). A ladder's jobs
    are validated with their budgets (one per rung) and refused at the first fault, since its rungs are one
    fit. The device a job asks for is checked (by `pick_device`, trmoe.runtime.env's: the caller's, as this
    layer loads no torch) only when the launcher runs it on this machine, and so is its wall time
    (`wall_time`, trmoe.plan.walltime.check_config): one job too long for trainer.max_hours refuses the
    sweep, since the jobs after it would wait behind it."""
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    checked_rungs: set[int] = set()
    invalid: dict[str, list[int]] = {}
    with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
        for number, job in enumerate(jobs):
            named = f"[sweep job {number}: {' '.join(job)}]"
            try:
                overrides = [o for o in job if not o.startswith("hydra.")]
                check_group_overrides(overrides)
                cfg = compose("config", overrides=overrides, return_hydra_config=True)
            except UserError as e:
                raise UserError(f"{e} {named}") from None
            except Exception as e:
                raise UserError(f"{compose_error(e)} {named}") from None
            local = _runs_here(cfg)
            with open_dict(cfg):
                del cfg["hydra"]  # as Hydra hands the job its config
            try:
                checked = to_config(cfg)
                if checked.ladder.name is not None:
                    if checked.ladder.rung not in checked_rungs:
                        _check_budgets(checked)
                    checked_rungs.add(checked.ladder.rung)
                if local and pick_device is not None:
                    check_device(checked.hardware.device.value, pick_device)
            except UserError as e:
                if cfg.ladder.name is not None:
                    raise UserError(f"{e} {named}") from None
                invalid.setdefault(str(e), []).append(number)
                continue
            if local and wall_time is not None:
                try:
                    wall_time(checked)
                except UserError as e:
                    raise UserError(f"{e} {named}; nothing was launched") from None
    if jobs and sum(len(numbers) for numbers in invalid.values()) == len(jobs):
        line, numbers = next(iter(invalid.items()))
        others = "" if len(numbers) == len(jobs) else "; every other job is invalid too"
        raise UserError(
            f"{line} [sweep jobs {_numbers(numbers)} of {len(jobs)}{others}; nothing was launched]"
        )


def _numbers(numbers: list[int]) -> str:
    """Job numbers as a user reads them: `0-7` for a run of them, else `0, 2, 5`."""
    if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(map(str, numbers))


def _runs_here(cfg) -> bool:
    """Whether the job's launcher runs it on this machine (Hydra's basic launcher, submitit's local one), so
    that this machine's devices are the job's: a SLURM job's GPUs are on its node, not here."""
    target = str(cfg.hydra.launcher.get("_target_", ""))
    return "BasicLauncher" in target or "LocalLauncher" in target


_DEVICE_LINES: dict[str, str | None] = {}


def check_device(device: str, pick_device: Callable[..., object]) -> None:
    """hardware.device is available here, as the job will find it when it starts (`pick_device`,
    trmoe.runtime.env's): a UserError otherwise. auto and cpu are always available; only another name asks
    (loading torch), once per name and process."""
    if device in ("auto", "cpu"):
        return
    if device not in _DEVICE_LINES:
        try:
            pick_device(device, label="config error: hardware")
            _DEVICE_LINES[device] = None
        except UserError as e:
            _DEVICE_LINES[device] = str(e)
    if _DEVICE_LINES[device] is not None:
        raise UserError(_DEVICE_LINES[device])


def _check_budgets(checked) -> None:
    """A ladder rung's budgets (trmoe.config.ladder.plan, at one rank's tokens per step)."""
    from trmoe.config.derived import global_batch_tokens
    from trmoe.config.ladder import plan

    plan(checked, global_batch_tokens(checked.trainer, 1))
