"""A run directory belongs to one live launch: `<run dir>/.lock`.

The lock is an exclusive `flock` on that file, held for the whole launch by one open file description (not a
POSIX `lockf`, which any close of the same file by the same process would silently drop). The kernel (or, on
NFS, the lock manager: Linux sends flock there as a whole-file POSIX lock) releases it when the process dies
in any way, SIGKILL included, so a dead launch never keeps it and nothing has to be cleaned up by hand. The
file also holds a record of the holder (host, pid, start time, SLURM job id and restart count) so that a
second launch is refused with one line naming it. The record is only informative: the lock itself decides.

Shared filesystems (docs/reliability.md, "One launch per run directory"): the lock is coherent across nodes
on NFSv3 (NLM) and NFSv4, on Lustre mounted with `-o flock`, on GPFS, CephFS and BeeGFS; with Lustre's `-o
localflock` or NFS's `-o nolock` it holds within one node only. A lock held by a node that is lost without
rebooting stays with the NFS server until its lease ends (NFSv4, ~90 s) or its lock recovery (NFSv3). A
requeue of the same SLURM job (the holder record names the same job id: SLURM starts the requeued job only
after the first one ended) therefore takes the directory over, with a warning, instead of being refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from trmoe.durable import json_text, nofollow
from trmoe.errors import RunFailed, UserError
from trmoe.run import storage
from trmoe.run.rundir import LOCK as LOCK_FILE
from trmoe.run.rundir import RunDir, named_by

log = logging.getLogger("trmoe")


def _job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID")


def _holder_record() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "slurm_job_id": _job_id(),
        "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"),
    }


def _describe(record: dict | None) -> str:
    if not record:
        return "another launch (its holder record is not written yet)"
    job = f", SLURM job {record['slurm_job_id']}" if record.get("slurm_job_id") else ""
    return f"pid {record.get('pid')} on {record.get('host')}{job}, started {record.get('started')}"


def refuse_links(run_dir: Path) -> None:
    """UserError (one line, nothing written) when a bookkeeping file of `run_dir` is a symbolic link: trmoe
    rewrites them in place, and a link would carry the write (or the read) outside the run directory."""
    linked = RunDir(run_dir).linked()
    if linked:
        raise UserError(
            f"run directory {run_dir}: {', '.join(linked)}: a symbolic link where trmoe keeps a record of "
            "the run (it never writes or reads these through a link); replace it with a plain file or remove "
            "it (nothing was changed)"
        )


def read_holder(run_dir: Path) -> dict | None:
    """The holder record of `run_dir`'s lock file (the last launch that held it; it may be dead)."""
    try:
        with open(run_dir / LOCK_FILE, opener=nofollow) as f:
            record = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def held(run_dir: Path) -> bool:
    """Whether a live launch holds `run_dir`'s lock. A shared, non-blocking flock of the file (not made when
    absent: a launch that ended cleanly removed it) succeeds only when no process holds it exclusively, and
    the kernel released a dead holder's: so a `running` status.json whose lock is free was left by a launch
    that has ended (trmoe.run.status). Within the holder's own process the answer is True too (flock is per
    open file description)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # (drops the shared lock: a launch starting now takes it)
    return False


class RunLock:
    """Context manager: hold `<run_dir>/.lock` while the launch lives; UserError (exit 2, nothing written)
    if another live launch holds it. Released (and the file removed) on exit; after a kill the file stays
    with the dead holder's record, and the next launch takes it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._made: list[Path] = []  # directories made for the lock: removed again if left empty

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        missing = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # read-only or full: exit 3; a file in the way: exit 2 (as when Hydra makes it)
            raise storage.cannot_create(e, self.run_dir) from None
        self._made = missing
        while True:
            try:  # O_NOFOLLOW: the holder record must never be written through a link
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    refuse_links(self.run_dir)
                if storage.is_storage_error(e, self.run_dir):  # the run's storage line (exit 3), as later
                    raise
                raise UserError(  # named: a .lock that is a directory (or a fifo, ...) is the cause
                    f"cannot lock the run directory {self.run_dir}: {self.path}: {e.strerror}; allowed: a "
                    "regular file (remove it: the lock is made anew) (nothing was changed)"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunFailed(f"cannot lock the run directory {self.run_dir}: {e.strerror}") from None
                holder = read_holder(self.run_dir)
                if holder and _job_id() and holder.get("slurm_job_id") == _job_id():
                    # the same SLURM job requeued: its first attempt has ended, but the lock of a lost node
                    # can outlive it on a shared filesystem (see the module docstring)
                    log.warning(
                        "%s: taking over the lock of this job's earlier attempt (%s)",
                        self.run_dir,
                        _describe(holder),
                    )
                    self._write_record()
                    return
                raise UserError(
                    f"run directory {self.run_dir} is in use by a live launch: {_describe(holder)}; "
                    f"wait for it to end or use another {named_by()} (nothing was changed)"
                ) from None
            # the file may have been removed by the holder that released it between our open and our lock:
            # then we hold a lock on a file nobody else can see; start again on the one at the path
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                try:
                    refuse_links(self.run_dir)
                except UserError:
                    self.release()
                    raise
                self._write_record()
                return
            os.close(fd)

    def _write_record(self) -> None:
        text = json_text(_holder_record()) + "\n"
        if self._fd is None:  # taken over without the kernel lock: rewrite the record only
            try:
                refuse_links(self.run_dir)
                with open(self.path, "w", opener=nofollow) as f:
                    f.write(text)
            except OSError:
                pass
            return
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)
        except OSError:  # a full disk: the lock holds without its record
            pass

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still locked: no other launch can be holding this file
        except OSError:
            pass
        os.close(self._fd)  # releases the lock
        self._fd = None
        for made in self._made:  # innermost first; rmdir removes only what is still empty
            try:
                made.rmdir()
            except OSError:
                break


def hold(run_dir: Path, rank: int = 0) -> contextlib.AbstractContextManager:
    """The lock of `run_dir`, taken by rank 0 of a launch (the other ranks share its directory)."""
    return RunLock(run_dir) if rank == 0 else contextlib.nullcontext()
