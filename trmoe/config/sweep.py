"""The jobs of a sweep, as Hydra's basic sweeper will launch them, known before anything is launched.

A sweep's jobs are every combination of the grid's `hydra.sweeper.params` (from `experiment=<name>`) and
of the comma-separated sweep overrides on the command line (`attention=gqa,mha`). `trmoe.match` solves each
of them; the train app composes each before Hydra writes the sweep directory, so a misspelt value in the
third job stops the launch with one line instead of after two jobs and a multirun.yaml.
"""

from __future__ import annotations

from hydra.types import RunMode

from trmoe.config.hydra_adapter import expand_sweep, parse_overrides
from trmoe.config.resolve import check_group_overrides, compose_error, compose_packaged
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


def check_jobs_compose(jobs: list[list[str]]) -> None:
    """Compose every job's config (no validation: a job that composes but is invalid fails on its own, as
    documented); the first that does not compose raises a one-line UserError naming its overrides. A
    ladder's jobs are validated too, with their budgets (one per rung): a ladder is refused whole, since
    its rungs are one fit."""
    from hydra import compose, initialize_config_module

    checked_rungs: set[int] = set()
    with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
        for number, job in enumerate(jobs):
            try:
                overrides = [o for o in job if not o.startswith("hydra.")]
                check_group_overrides(overrides)
                cfg = compose("config", overrides=overrides)
                if cfg.ladder.name is not None:
                    _check_ladder(cfg, budgets=cfg.ladder.rung not in checked_rungs)
                    checked_rungs.add(cfg.ladder.rung)
            except UserError as e:
                raise UserError(f"{e} [sweep job {number}: {' '.join(job)}]") from None
            except Exception as e:
                raise UserError(f"{compose_error(e)} [sweep job {number}: {' '.join(job)}]") from None


def _check_ladder(cfg, budgets: bool) -> None:
    """A ladder job's config, and (once per rung) its budgets (trmoe.config.ladder.plan, at one rank's
    tokens per step)."""
    from trmoe.config.derived import global_batch_tokens
    from trmoe.config.ladder import plan
    from trmoe.config.resolve import to_config

    checked = to_config(cfg)
    if budgets:
        plan(checked, global_batch_tokens(checked.trainer, 1))
