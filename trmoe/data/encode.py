"""Tokenizing documents in worker processes, in order, with bounded memory.

Shared by the prepare tool and the streamed (fineweb) corpus. Workers are started with the `spawn`
method (safe in a process that already runs torch, threads or pyarrow) and load the o200k tokenizer once.
Results come back in submission order, and at most `max_in_flight` chunks are outstanding, so a corpus larger
than memory streams through.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from trmoe.data.corpus import is_eval_document
from trmoe.data.tokenizer import EOS_ID, load_o200k


def encode_documents(
    texts: list[str], eval_fraction: float, split_seed: int, encode: str = "all"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each text: its split (the stable content-hash rule of trmoe.data.corpus), its UTF-8 byte count,
    and its o200k ids followed by EOS. Returns (is_eval bool[n], text_bytes int64[n], lengths int64[n],
    ids uint32[sum(lengths)]). encode="train" or "eval" tokenizes only that split's texts (the others get
    length 0)."""
    is_eval = np.fromiter(
        (is_eval_document("", t, eval_fraction, split_seed) for t in texts), dtype=bool, count=len(texts)
    )
    text_bytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
    wanted = np.ones(len(texts), dtype=bool) if encode == "all" else is_eval == (encode == "eval")
    todo = [t for t, w in zip(texts, wanted, strict=True) if w]
    # One process = one thread: tiktoken's encode_ordinary_batch is a thread pool around encode_ordinary, and
    # its per-document futures halve the speed on short documents (`python -m trmoe.bench data`).
    # Parallelism comes from the worker processes.
    tokenize = load_o200k().encode_ordinary
    encoded = [tokenize(t) for t in todo]
    lengths = np.zeros(len(texts), dtype=np.int64)
    lengths[wanted] = [len(ids) + 1 for ids in encoded]
    for ids in encoded:
        ids.append(EOS_ID)
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
    # traceback, and one killed while it holds the task queue's lock deadlocks Pool.terminate(); so the
    # workers leave the group (and ignore Ctrl-C until they have).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)
    load_o200k()


def make_pool(workers: int):
    """A spawn-started process pool of `workers` tokenizer processes, or None for workers == 0.

    The workers run only functions of this module, so they are started without the parent's __main__ (which
    spawn re-imports by default: that would re-run a script without a `__main__` guard, and fails outright
    for `python -` or `python -c`)."""
    if workers <= 0:
        return None
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__spec__", "__file__") if hasattr(main, name)}
    # A worker is exposed to the group's Ctrl-C from its exec until _init_worker ignores it: one that gets
    # it while importing `site` dies with a fatal error. SIGINT stays blocked while the workers start: they
    # inherit the mask (so it waits in them until _init_worker ignores it), and this process receives its
    # own Ctrl-C when the mask is restored.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        if main is not None:
            main.__spec__ = None
            if "__file__" in saved:
                del main.__file__
        return multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(os.getpid(),)
        )
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def ordered_map(
    pool, fn: Callable[..., Any], tasks: Iterable[tuple[Any, tuple]], max_in_flight: int
) -> Iterator[tuple[Any, Any]]:
    """For each (tag, args) of `tasks`, in order: (tag, fn(*args)), computed by `pool` (inline when pool is
    None) with at most `max_in_flight` tasks submitted ahead of the consumer. Tags stay in this process."""
    if pool is None:
        for tag, args in tasks:
            yield tag, fn(*args)
        return
    pending: collections.deque = collections.deque()
    for tag, args in tasks:
        pending.append((tag, pool.apply_async(fn, args)))
        if len(pending) >= max_in_flight:
            done_tag, result = pending.popleft()
            yield done_tag, result.get()
    while pending:
        done_tag, result = pending.popleft()
        yield done_tag, result.get()
