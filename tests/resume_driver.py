"""Run the real app (`trmoe.train.__main__.main`, i.e. `python -m trmoe.train`) in this process, with one
deterministic fault injected from outside the production code, then let the process die as it would.

    python tests/resume_driver.py <fault> <hydra overrides...>

Faults (k = optimizer step; the process SIGKILLs itself, exactly like `kill -9` from outside):
    none                   no fault
    step:k:forward         in step k's forward pass
    step:k:after           after step k (its row and checkpoint written), before step k+1
    eval:k                 in the evaluation of step k
    save:k:payload         half-way through writing model_optim.pt of checkpoint k
    save:k:rank            while writing rank_00000.pt of checkpoint k
    save:k:meta            after meta.json of checkpoint k is written, before the directory rename
    save:k:rename          after the rename, before `latest` is updated
    save:k:pointer         with latest's temporary file written, before it replaces `latest`
    save:k:prune           after an old checkpoint was renamed for deletion, before it is deleted
    signal:k:USR2          the process sends itself SIGUSR2 (or TERM) in step k's forward
    nan:k:n                the loss of steps k .. k+n-1 is NaN (exit code 3 once guard.max_skips trips)

Ladder faults (r = the r-th run this process trains, from 0: a ladder job trains its stable run, then a
branch per budget, in one process; trmoe.train.ladder):
    ladder:r:before        before run r starts (the run before it finished; run r's directory not made)
    ladder:r:locked        run r's directory and lock made, nothing else written
    ladder:r:running       its launch's writes made (.hydra/, train.log, status.json "running"), no
                           run_config.json yet
    ladder:r:recorded      run_config.json written, no step trained
    ladder:r:step:k        in step k's forward of run r
    ladder:r:saving        half-way through writing run r's first checkpoint
    ladder:r:saved         run r's first checkpoint complete (`latest` names it), nothing after it
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys

import trmoe.run.checkpoint as ckpt
from trmoe.train.objective import Objective
from trmoe.train.scheduler import Scheduler

current = {"step": 0, "saving": None}


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(fault: str) -> None:
    if fault == "none":
        return
    if fault.startswith("ladder:"):
        return install_ladder(*fault.split(":")[1:])
    kind, k, *rest = fault.split(":")
    k = int(k)
    phase = rest[0] if rest else ""

    begin_step = Scheduler.begin_step

    def tracked_begin_step(self, step):
        if kind == "step" and phase == "after" and step == k + 1:
            die()
        current["step"] = step
        return begin_step(self, step)

    Scheduler.begin_step = tracked_begin_step

    if kind in ("step", "signal"):
        forward = Objective.forward

        def faulty_forward(self, inputs, targets=None):
            if current["step"] == k:
                if kind == "step" and phase == "forward":
                    die()
                if kind == "signal":
                    os.kill(os.getpid(), getattr(signal, f"SIG{phase}"))
            return forward(self, inputs, targets)

        Objective.forward = faulty_forward

    if kind == "nan":
        loss = Objective.loss

        def nan_loss(self, hidden, targets):
            sums = loss(self, hidden, targets)
            if k <= current["step"] < k + int(phase):
                return type(sums)(sums.total * float("nan"), sums.ce * float("nan"), sums.z, sums.tokens)
            return sums

        Objective.loss = nan_loss

    if kind == "eval":
        import trmoe.train.observe.evaluation as evaluation

        evaluate = evaluation.evaluate

        def faulty_evaluate(*args, **kwargs):
            if current["step"] == k:
                die()
            return evaluate(*args, **kwargs)

        evaluation.evaluate = faulty_evaluate

    if kind == "save":
        save = ckpt.CheckpointStore.save

        def tracked_save(self, step, **kwargs):
            current["saving"] = step
            try:
                return save(self, step, **kwargs)
            finally:
                current["saving"] = None

        ckpt.CheckpointStore.save = tracked_save
        ours = lambda: current["saving"] == k  # noqa: E731

        if phase == "payload":
            write = ckpt._ChecksumWriter.write

            def half_write(self, data):
                if ours() and self.bytes > 200_000:
                    die()
                return write(self, data)

            ckpt._ChecksumWriter.write = half_write
        elif phase == "rank":
            write_durable = ckpt._write_durable

            def faulty_write_durable(path, obj):
                if ours() and path.name.startswith("rank_"):
                    with open(path, "wb") as f:
                        f.write(b"PK\x03\x04 partial")
                    die()
                return write_durable(path, obj)

            ckpt._write_durable = faulty_write_durable
        elif phase == "meta":
            fsync_dir = ckpt.fsync_dir

            def faulty_fsync_dir(path):
                fsync_dir(path)
                if ours() and path.name.startswith(".step_"):
                    die()

            ckpt.fsync_dir = faulty_fsync_dir
        elif phase == "rename":
            write_pointer = ckpt.write_pointer

            def faulty_write_pointer(directory, name):
                if ours():
                    die()
                return write_pointer(directory, name)

            ckpt.write_pointer = faulty_write_pointer
        elif phase == "pointer":
            replace = os.replace

            def faulty_replace(src, dst, *args, **kwargs):
                if ours() and os.path.basename(dst) == ckpt.LATEST:
                    die()
                return replace(src, dst, *args, **kwargs)

            ckpt.os.replace = faulty_replace
        elif phase == "prune":
            rmtree = shutil.rmtree

            def faulty_rmtree(path, *args, **kwargs):
                if ours() and str(path).endswith(".deleting"):
                    die()
                return rmtree(path, *args, **kwargs)

            ckpt.shutil.rmtree = faulty_rmtree
        else:
            raise SystemExit(f"unknown save phase {phase!r}")


def install_ladder(r: str, phase: str, k: str = "0") -> None:
    """The ladder faults (module docstring): run r counted at each trmoe.train.loop.train call."""
    import trmoe.run.lock as lock
    import trmoe.run.status as status
    import trmoe.train.loop as loop
    import trmoe.train.run_record as run_record

    runs = {"index": -1, "step": 0, "saves": 0}
    ours = lambda: runs["index"] == int(r)  # noqa: E731
    train = loop.train

    def counted_train(*args, **kwargs):
        runs["index"] += 1
        runs["saves"] = 0
        if ours() and phase == "before":
            die()
        return train(*args, **kwargs)

    loop.train = counted_train
    if phase == "before":
        pass
    elif phase == "locked":
        hold = lock.hold

        @contextlib.contextmanager
        def faulty_hold(*args, **kwargs):
            with hold(*args, **kwargs) as held:
                if ours():
                    die()
                yield held

        lock.hold = faulty_hold
    elif phase == "running":
        write_status = status.write_status

        def faulty_write_status(run_dir, value, **fields):
            write_status(run_dir, value, **fields)
            if ours() and value == status.RUNNING:
                die()

        status.write_status = faulty_write_status
    elif phase == "recorded":
        announce = run_record.announce

        def faulty_announce(*args, **kwargs):
            announce(*args, **kwargs)
            if ours():
                die()

        run_record.announce = faulty_announce
    elif phase == "step":
        begin_step, forward = Scheduler.begin_step, Objective.forward

        def tracked_begin_step(self, step):
            runs["step"] = step
            return begin_step(self, step)

        def faulty_forward(self, inputs, targets=None):
            if ours() and runs["step"] == int(k):
                die()
            return forward(self, inputs, targets)

        Scheduler.begin_step, Objective.forward = tracked_begin_step, faulty_forward
    elif phase in ("saving", "saved"):
        save, write = ckpt.CheckpointStore.save, ckpt._ChecksumWriter.write

        def faulty_save(self, step, **kwargs):
            runs["saves"] += 1
            out = save(self, step, **kwargs)
            if ours() and runs["saves"] == 1 and phase == "saved":
                die()
            return out

        def half_write(self, data):
            if ours() and runs["saves"] == 1 and phase == "saving" and self.bytes > 1000:
                die()
            return write(self, data)

        ckpt.CheckpointStore.save, ckpt._ChecksumWriter.write = faulty_save, half_write
    else:
        raise SystemExit(f"unknown ladder phase {phase!r}")


def run(fault: str, argv: list[str]) -> int:
    """The app's exit code with `fault` installed (or the process's death)."""
    install(fault)
    from trmoe.train.__main__ import main

    return main(argv)


def forked(
    fault: str, argv: list[str], cwd: str, env: dict[str, str] | None = None, stem: str = "driver"
) -> None:
    """The target of helpers.start_forked's child (a process forked from a server that has the training
    stack imported): `python resume_driver.py <fault> <argv>` from `cwd` with `env` added to the environment,
    its stdout and stderr in <stem>.stdout and <stem>.stderr (relative to cwd)."""
    os.chdir(cwd)
    os.environ.update(env or {})
    for fd, suffix in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(f"{stem}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout.reconfigure(line_buffering=True)  # what the killed attempt printed is there, as unbuffered
    sys.exit(run(fault, argv))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2:]))
