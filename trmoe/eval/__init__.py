"""Downstream evaluation through lm-evaluation-harness (the `eval` extra): the harness's tasks, offline.

`run_tasks` is the one entrance (`python -m trmoe.eval`, the in-training evaluation): it checks every task
name against the harness's registry (and `include_path`, local task YAMLs), loads each task's data with
downloads off, so a task whose data is not on this machine is one line naming it, and runs the harness.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

from trmoe.errors import UserError

# Nothing downloads at run time: datasets and the hub read their local caches only.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")


def _harness():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("eval: needs lm-evaluation-harness; install: pip install 'trmoe[eval]'") from None
    from trmoe.eval.task_index import CachedTaskManager

    return CachedTaskManager


@functools.lru_cache(maxsize=4)
def _manager(include_path: str | None, defaults: bool):
    """The harness's task index: its own ~15,000 task YAMLs take ~7 s to index, so local tasks alone are
    indexed without them when they are all that is asked for; their index is kept on disk between
    processes (trmoe.eval.task_index) and in memory for the process."""
    TaskManager = _harness()
    return TaskManager(include_path=include_path, include_defaults=defaults)


def load_tasks(tasks: list[str], include_path: str | None = None) -> tuple[Any, dict]:
    """(TaskManager, the harness's task dict) of `tasks`; UserError for an unknown task or one whose data is
    not available offline."""
    if not tasks:
        raise UserError("tasks: empty; allowed: one or more lm-eval task names, e.g. tasks=[arc_easy]")
    if include_path is not None and not os.path.isdir(include_path):
        raise UserError(f"include_path={include_path}: not a directory; allowed: a folder of task YAML files")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on every custom task: not a problem
    manager = _manager(include_path, defaults=False) if include_path is not None else None
    local = set(manager.all_tasks) if manager is not None else set()
    if not set(tasks) <= local:
        _refuse_unwritten([t for t in tasks if t not in local], sorted(local), include_path)
        manager = _manager(include_path, defaults=True)
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            raise UserError(_unknown_task(task, sorted(known), include_path))
    loaded = {}
    for task in tasks:
        try:
            loaded[task] = manager.load([task])
        except Exception as e:  # datasets' offline errors differ by version: ConnectionError, OSError, ...
            first = next(iter(str(e).splitlines()), type(e).__name__)[:200]
            raise UserError(
                f"tasks: {task}: its data is not available offline ({type(e).__name__}: {first}); allowed: a "
                "task whose data is in the datasets cache, or a local task YAML (include_path)"
            ) from None
    return manager, loaded


def _unknown_task(task: str, known: list[str], include_path: str | None) -> str:
    import difflib

    close = difflib.get_close_matches(task, known, n=3)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"tasks: unknown task {task!r}; {hint}allowed: a task of `lm_eval ls tasks`" + (
        f" or of {include_path}" if include_path else " (or include_path=<folder of task YAMLs>)"
    )


def _refuse_unwritten(tasks: list[str], local: list[str], include_path: str | None) -> None:
    """Before the harness indexes its own tasks for the first time (a minute on a slow disk; later ones read
    the cache): a name that none of its files contains is refused now, with the close names its YAMLs
    declare."""
    _harness()
    from trmoe.eval.task_index import CachedTaskManager, is_cached, unwritten

    root = CachedTaskManager.defaults
    if not tasks or is_cached(root):
        return
    missing, declared = unwritten(root, tasks)
    if missing:
        raise UserError(_unknown_task(missing[0], sorted({*declared, *local}), include_path))


def run_tasks(
    lm,
    tasks: list[str],
    *,
    include_path: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100000,
) -> dict:
    """The harness's results dict (results, configs, versions, n-samples; samples when asked), without its
    description of the machine (`_no_machine_report`)."""
    from lm_eval import simple_evaluate

    manager, _ = load_tasks(tasks, include_path)
    with _no_machine_report():
        results = simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
        )
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    return results


@contextlib.contextmanager
def _no_machine_report():
    """simple_evaluate ends every call by describing the machine into its results dict (git's hash, and
    torch.utils.collect_env: `pip list`, nvidia-smi and more in child processes, ~1 s of CPU and 1-2 s of
    wall each time, so at every in-training evaluation). trmoe keeps the figures only (the eval record:
    results, n-samples, versions; the training columns), so those two steps do nothing during the call.
    The harness's own command line (`trmoe-lm-eval`) does not come through here and still writes them."""
    from lm_eval import evaluator

    names = [n for n in ("add_env_info", "get_git_commit_hash") if hasattr(evaluator, n)]
    saved = {n: getattr(evaluator, n) for n in names}
    for name in names:
        setattr(evaluator, name, lambda *_: None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(evaluator, name, value)
