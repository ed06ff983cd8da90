"""Tokenizing documents in worker processes, in order, with bounded memory.

Shared by the prepare tool and the streamed (fineweb) corpus. Workers are started with the `spawn`
method (safe in a process that already runs torch, threads or pyarrow) and load the o200k tokenizer once.
Results come back in submission order, and at most `max_in_flight` chunks are outstanding, so a corpus larger
than memory streams through.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np

from trmoe.data.corpus import is_eval_document
from trmoe.data.tokenizer import load_o200k, load_tokenizer


def encode_documents(
    texts: list[str], eval_fraction: float, split_seed: int, encode: str = "all", bpe: str | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each text: its split (the stable content-hash rule of trmoe.data.corpus), its UTF-8 byte count,
    and its ids followed by EOS (o200k_base, or the BPE tokenizer.json at `bpe`). Returns (is_eval bool[n],
    text_bytes int64[n], lengths int64[n], ids uint32[sum(lengths)]). encode="train" or "eval" tokenizes
    only that split's texts (the others get length 0)."""
    is_eval = np.fromiter(
        (is_eval_document("", t, eval_fraction, split_seed) for t in texts), dtype=bool, count=len(texts)
    )
    text_bytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
    wanted = np.ones(len(texts), dtype=bool) if encode == "all" else is_eval == (encode == "eval")
    todo = [t for t, w in zip(texts, wanted, strict=True) if w]
    # One process = one thread: tiktoken's encode_ordinary_batch is a thread pool around encode_ordinary, and
    # its per-document futures halve the speed on short documents (`python -m trmoe.bench data`).
    # Parallelism comes from the worker processes.
    tok = load_tokenizer("bpe", bpe) if bpe is not None else load_tokenizer()
    tokenize = tok.encode_ordinary
    encoded = [tokenize(t) for t in todo]
    lengths = np.zeros(len(texts), dtype=np.int64)
    lengths[wanted] = [len(ids) + 1 for ids in encoded]
    for ids in encoded:
        ids.append(tok.eos_id)
    flat = (
        np.concatenate([np.asarray(ids, dtype=np.uint32) for ids in encoded])
        if encoded
        else np.zeros(0, np.uint32)
    )
    return is_eval, text_bytes, lengths, flat


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(parent: int) -> None:
    """Linux: this process gets SIGKILL when its parent dies (a parent killed by the OOM killer or SIGKILL
    runs no cleanup, and an idle worker, which holds its task queue's write end itself, would wait on it
    forever). If the parent died before the request took effect, exit now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _init_worker(parent: int) -> None:
    _die_with(parent)  # no worker outlives the process that started it
    # Ctrl-C, and a SIGTERM/SIGHUP sent to the whole process group, are the parent's to handle: it stops
    # the pool and removes its partial files. A worker of the group would print a KeyboardInterrupt
    # traceback, and one killed breaks the pool and loses the chunk it held; so the workers leave the group
    # (and ignore Ctrl-C until they have).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)
    load_o200k()


class WorkerPool:
    """`workers` spawn-started tokenizer processes: a concurrent.futures.ProcessPoolExecutor.

    Not multiprocessing.Pool: its terminate() deadlocks when a worker is part-way through sending a large
    result (the worker holds the result queue's lock while the pipe is full; terminate() first stops the
    thread that reads the pipe, then waits for that lock). The executor's manager thread reads results until
    its workers have exited, and a worker that dies fails the pending tasks (BrokenProcessPool) instead of
    leaving them waiting forever.

    Every worker is started (and has loaded the tokenizer) when the constructor returns: the executor starts
    a worker in each submit() made while none is idle, and a caller defers Ctrl-C around the start-up only
    (an interrupted start leaves a half-started child that prints a traceback)."""

    def __init__(self, workers: int):
        self._executor = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(os.getpid(),),
        )
        try:
            with _spawning():
                started = [self._executor.submit(os.getpid) for _ in range(workers)]
            for worker in started:
                worker.result()
        except BaseException:
            self.close()
            raise

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._executor.submit(fn, *args)

    def close(self) -> None:
        """Drops the tasks not started yet and returns once the workers have finished the ones they hold
        (a chunk each) and exited."""
        self._executor.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _spawning() -> Iterator[None]:
    """What a worker started inside this block needs from its parent.

    The workers run only functions of this module, so they start without the parent's __main__ (which spawn
    re-imports by default: that would re-run a script without a `__main__` guard, and fails outright for
    `python -` or `python -c`). A worker is exposed to the group's Ctrl-C from its exec until _init_worker
    ignores it, and one that gets it while importing `site` dies with a fatal error; so SIGINT stays blocked
    here: the worker inherits the mask (the signal waits in it until _init_worker ignores it), and this
    process receives its own Ctrl-C when the mask is restored."""
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__spec__", "__file__") if hasattr(main, name)}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        if main is not None:
            main.__spec__ = None
            if "__file__" in saved:
                del main.__file__
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def make_pool(workers: int) -> WorkerPool | None:
    """A pool of `workers` tokenizer processes, or None (tokenize inline) for workers == 0."""
    return WorkerPool(workers) if workers > 0 else None


def ordered_map(
    pool: WorkerPool | None, fn: Callable[..., Any], tasks: Iterable[tuple[Any, tuple]], max_in_flight: int
) -> Iterator[tuple[Any, Any]]:
    """For each (tag, args) of `tasks`, in order: (tag, fn(*args)), computed by `pool` (inline when pool is
    None) with at most `max_in_flight` tasks submitted ahead of the consumer. Tags stay in this process."""
    if pool is None:
        for tag, args in tasks:
            yield tag, fn(*args)
        return
    pending: collections.deque = collections.deque()
    for tag, args in tasks:
        pending.append((tag, pool.submit(fn, *args)))
        if len(pending) >= max_in_flight:
            done_tag, result = pending.popleft()
            yield done_tag, result.result()
    while pending:
        done_tag, result = pending.popleft()
        yield done_tag, result.result()
