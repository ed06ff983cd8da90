"""One Cadence for every periodic job of a run: the steps it gives are those of the rules it replaced
(written out below as they were, before #30), for every (every, steps) pair of a grid."""

from __future__ import annotations

import itertools

import pytest

from trmoe.config.schema import CheckpointConfig, TrainerConfig
from trmoe.run.cadence import NEVER, Cadence
from trmoe.run.checkpoint import CheckpointStore
from trmoe.run.rundir import RunDir
from trmoe.train.observe.downstream import downstream_cadence
from trmoe.train.observe.evaluation import held_out_cadence
from trmoe.train.observe.output import log_cadence

STEPS = (1, 2, 3, 7, 10, 12, 50)
EVERY = (0, 1, 2, 3, 5, 10, 50, 60)


def old_is_log_step(step: int, t: TrainerConfig) -> bool:  # controls.is_log_step
    is_eval = step == t.steps or (t.eval_every > 0 and step % t.eval_every == 0)
    return is_eval or step == 1 or step % t.log_every == 0


def old_held_out_due(step: int, t: TrainerConfig) -> bool:  # HeldOutLoss.due
    return step in (0, t.steps) or (t.eval_every > 0 and step % t.eval_every == 0)


def old_downstream_due(step: int, tasks: bool, every: int, last: int) -> bool:  # Downstream.due
    return tasks and (step in (0, last) or (every > 0 and step % every == 0))


def old_checkpoint_due(step: int, enabled: bool, every_steps: int, final: bool) -> bool:  # store.due
    return enabled and (final or (every_steps > 0 and step % every_steps == 0))


def steps_of(due, steps: int, *args, **kwargs) -> list[int]:
    return [s for s in range(steps + 2) if due(s, *args, **kwargs)]


@pytest.mark.parametrize("steps", STEPS)
def test_the_runs_cadences_give_the_steps_of_the_old_rules(steps, tmp_path):
    for log_every, eval_every in itertools.product([e for e in EVERY if e > 0], EVERY):
        t = TrainerConfig(steps=steps, log_every=log_every, eval_every=eval_every)
        assert steps_of(held_out_cadence(t).due, steps) == steps_of(old_held_out_due, steps, t)
        # the metrics rows (besides the evaluators' steps and a halt) and telemetry's gradient norms
        assert steps_of(log_cadence(t).due, steps) == steps_of(old_is_log_step, steps, t)
    for every, eval_every in itertools.product([None, *EVERY], EVERY):
        t = TrainerConfig(steps=steps, eval_every=eval_every)
        period = eval_every if every is None else every
        new = downstream_cadence(t, every)
        assert steps_of(new.due, steps) == steps_of(old_downstream_due, steps, True, period, steps)
    run = RunDir(tmp_path)
    for every_steps, enabled in itertools.product(EVERY, (True, False)):
        config = CheckpointConfig(every_steps=every_steps, enabled=enabled)
        store = CheckpointStore.for_run(config, run, last_step=steps)
        for final in (True, False):
            # the old callers passed final=True at the last step themselves
            old = [
                s
                for s in range(steps + 2)
                if old_checkpoint_due(s, enabled, every_steps, final or s == steps)
            ]
            assert steps_of(store.due, steps, final=final) == old


def test_a_cadence_is_due_at_its_steps_and_its_multiples():
    c = Cadence(4, at=(1, 10))
    assert steps_of(c.due, 12) == [0, 1, 4, 8, 10, 12]
    assert steps_of(Cadence(0, at=(3,)).due, 12) == [3]  # every=0: never periodically
    assert steps_of((Cadence(4) | Cadence(6, at=(1,))).due, 12) == [0, 1, 4, 6, 8, 12]
    assert steps_of(NEVER.due, 12) == [] and Cadence(0) == NEVER
    assert Cadence([3, 3, 0], at=[2]) == Cadence(3, at=(2,))
