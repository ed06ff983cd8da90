"""pytest fixtures and hooks; the shared helper functions and override lists are in helpers.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import compose_config, descendants, train_in_process
from presets import RESUME_SMALL, TEXT_RUN, TRAINING_SENTENCES

# One intra-op thread in every test process and its children: the workers are as many as the cores, so a
# second thread only oversubscribes them, and an OpenMP thread that waits for a busy core burns CPU (a
# coordinate check with the other core busy: 2.6x the CPU of one thread, docs/performance.md). Set before a
# child or a worker imports torch (both inherit the environment); a test that needs more threads sets them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Nothing downloads at test time: transformers, datasets and lm-eval read local files only.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

# The Ctrl-C tests send SIGINT to a child as a terminal would. A suite started in the background of a
# non-interactive shell (`make test &`) inherits SIGINT ignored, and every child would inherit that too (an
# ignored signal stays ignored across exec, and trmoe leaves it so, as it should): Python's own handler
# here, which exec resets to the default in a child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# trmoe's cache (lm-eval's task index, trmoe.eval.task_index) is a folder of this session, never the user's:
# made by the first process (xdist's controller, whose workers and their children inherit it), removed at its
# end. The session's first full index fills it; every later process reads it.
# Compiled bytecode likewise: the ~150 child processes would each compile trmoe again (~0.2 s of CPU each)
# where the machine says not to write bytecode (PYTHONDONTWRITEBYTECODE), so the session keeps it in a
# folder of its own (PYTHONPYCACHEPREFIX), never beside the sources.
if "PYTEST_XDIST_WORKER" not in os.environ:
    _CACHE = os.environ["TRMOE_CACHE_DIR"] = tempfile.mkdtemp(prefix="trmoe-test-cache-")
    _PYCACHE = os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="trmoe-test-pycache-")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(_CACHE, ignore_errors=True)
        shutil.rmtree(_PYCACHE, ignore_errors=True)


@pytest.fixture
def one_thread():
    """One torch thread during the test (as hardware.threads=1 sets it), the previous count afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tmpfs(tmp_path):
    """A real filesystem of 6 MiB that fills (tmpfs), unmounted afterwards; skipped where mount is refused.
    `mount -o remount,ro` makes it read-only for root too (chmod does not stop root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def compose_cfg():
    return compose_config


@pytest.fixture(autouse=True)
def _keep_thread_count():
    """A test that trains in-process with hardware.threads=1 leaves the torch thread count as it found it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _ours(pid: int) -> bool:
    """Whether the process is one a test launches and may leave running when it fails half-way (a timeout,
    a wait that never ends): a trmoe app or console script, a driver or a torchrun agent. Read from its
    argv, not from its whole command line: a checkout in a folder named trmoe puts that name in every
    path, the venv's interpreter included (multiprocessing's resource tracker, inductor's compile workers)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except FileNotFoundError:
        return False
    program = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else Path(argv[min(1, len(argv) - 1)]).name
    return (
        program.startswith("trmoe")
        or program in ("resume_driver.py", "torch.distributed.run")
        or Path(argv[0]).name.startswith("trmoe-")
    )


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    """A process of ours (_ours; or a run forked from the fork server) that a test started and left running
    is killed when the test ends, with everything below it: a failed test's run of 100000 steps would
    otherwise burn a core under the rest of the suite, and after it. The fork server (helpers.fork_server)
    itself lives for the session."""
    import multiprocessing.forkserver

    before = set(descendants(os.getpid()))
    yield
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    forked = set(descendants(server)) if server else set()
    for pid in descendants(os.getpid()):
        if pid in before or pid == server or not (pid in forked or _ours(pid)):
            continue
        for leftover in (pid, *descendants(pid)):
            try:
                os.kill(leftover, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def small_run(tmp_path_factory) -> Path:
    """A finished 4-step run (RESUME_BASE + RESUME_SMALL) with checkpoints at 2 and 4; tests copy it or
    launch against it, never change it."""
    run_dir = tmp_path_factory.mktemp("small") / "r"
    train_in_process(run_dir, *RESUME_SMALL)
    return run_dir


@pytest.fixture(scope="session")
def text_run(tmp_path_factory, worker_id) -> Path:
    """The run directory of a tiny model (TEXT_RUN) trained on TRAINING_SENTENCES (and a held-out filler
    document): what trmoe.sample, trmoe.export and trmoe.eval are tested on. ~10 s on one core, once per
    session: under pytest-xdist the first worker to ask trains it in the session's shared temporary
    directory, under a file lock, and the others read it (pytest-xdist's documented FileLock pattern)."""
    if worker_id == "master":
        return _train_text_run(tmp_path_factory.mktemp("text_run"))
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent / "text_run"  # the session's, shared by its workers
    with FileLock(f"{root}.lock"):
        if not (root / "trained").is_file():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way
            root.mkdir()
            _train_text_run(root)
            (root / "trained").touch()
    return root / "run"


def _train_text_run(root: Path) -> Path:
    from trmoe.train.loop import train

    corpus = root / "corpus.txt"
    docs = [" ".join(TRAINING_SENTENCES)] * 20 + ["Held out text about something else entirely."] * 3
    corpus.write_text("\n\n".join(f"{d} ({i})" for i, d in enumerate(docs)) + "\n")
    run_dir = root / "run"
    threads = torch.get_num_threads()  # a session fixture: set up outside _keep_thread_count
    try:
        train(compose_config(*TEXT_RUN, f"data.text_path={corpus}"), run_dir)
    finally:
        torch.set_num_threads(threads)
    return run_dir


@pytest.fixture(scope="session")
def exported(text_run, tmp_path_factory) -> Path:
    """text_run exported as a Hugging Face directory (python -m trmoe.export's format hf)."""
    pytest.importorskip("transformers")
    from trmoe.export import export
    from trmoe.load import load_model

    return export(load_model(text_run), tmp_path_factory.mktemp("export") / "hf")


# The test files that take longest on two workers, longest first (the per-file figures: docs/performance.md,
# "The test suite's wall time"). `make test` hands files to its workers in collection order
# (--no-loadscope-reorder); without it pytest-xdist starts the files with the most tests first, so a long file
# of few tests (the scaling-law coverage, the SLURM and submitit jobs) started last and left the other core
# idle at the end. Longest first, the short files fill in around the long ones.
LONGEST_FIRST = (
    "test_scaling_doc.py",  # a real shortened ladder_smoke (~200 s of CPU): docs/scaling.md's excerpt
    "test_scaling_laws.py",
    "test_downstream.py",
    "test_train.py",
    "test_eval.py",
    "test_mixture.py",
    "test_resume.py",
    "test_submitit_local.py",
    "test_learned_router.py",
    "test_doc_commands.py",
    "test_export.py",
    "test_distributed.py",
    "test_trackers.py",
    "test_reliability.py",
    "test_slurm.py",
    "test_experiments.py",
    "test_ladder_resume.py",
    "test_resume_world.py",
    "test_wheel.py",
)


def pytest_collection_modifyitems(config, items):
    """The tiers (markers registered in pyproject.toml): `@pytest.mark.slow` runs everywhere (CI included;
    `-m "not slow"` leaves it out locally); `@pytest.mark.slow(opt_in="why")` runs only with
    TRMOE_SLOW_TESTS=1; `@pytest.mark.gpu` is skipped, saying so, without a CUDA device. The files are put
    in LONGEST_FIRST's order (a stable sort: each file's own order, and the other files', is kept)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(pytest.mark.skip(reason="no CUDA device on this machine"))
    if os.environ.get("TRMOE_SLOW_TESTS"):
        return
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None and marker.kwargs.get("opt_in"):
            item.add_marker(
                pytest.mark.skip(reason=f"{marker.kwargs['opt_in']} (TRMOE_SLOW_TESTS=1 runs it)")
            )
