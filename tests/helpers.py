"""Helpers the tests share (import them: `from helpers import ...`); the fixtures are in conftest.py."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig
from presets import DISTRIBUTED_TINY, RESUME_BASE

import trmoe.config.schema  # noqa: F401  (registers the schemas)
from trmoe.data.shards import INDEX_NAME, write_shard

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(*overrides: str) -> DictConfig:
    """Real Hydra composition of the packaged config tree, as the app does it."""
    with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
        return compose("config", overrides=list(overrides))


# metrics.csv columns that are measured, not computed: every bit-exactness comparison leaves them out
TIMING_COLUMNS = ("tok_s", "elapsed_s", "mfu", "peak_mem_gib")


# ------------------------------------------------------------------ launching the tools
# Two ways, one helper each: `cli` calls a tool's main(argv) in this process (what a bad-input case needs:
# the exit code and the one line, without a child paying the imports again); `python`/`start` run a real
# child process (what a signal, a kill, a lock held by another process, torchrun or an import check needs).

MAINS = {  # python -m <module> -> the module whose main(argv) it runs
    "trmoe.train": "trmoe.train.__main__",
    "trmoe.report": "trmoe.report.__main__",
    "trmoe.plan": "trmoe.plan.__main__",
    "trmoe.bench": "trmoe.bench.__main__",
    "trmoe.export": "trmoe.export.__main__",
    "trmoe.eval": "trmoe.eval.__main__",
}


def cli(args: list[str], cwd: Path, module: str = "trmoe.train") -> subprocess.CompletedProcess:
    """`python -m <module> <args>` from `cwd`, run in this process by the tool's own main(argv): its exit
    code and its stdout and stderr, as run_cli gives them. The working directory and the torch thread count
    are restored afterwards."""
    import importlib

    main = importlib.import_module(MAINS.get(module, module)).main
    out, err = io.StringIO(), io.StringIO()
    previous, threads = os.getcwd(), torch.get_num_threads()
    full_error = os.environ.pop("HYDRA_FULL_ERROR", None)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(previous)
        torch.set_num_threads(threads)
        if full_error is not None:
            os.environ["HYDRA_FULL_ERROR"] = full_error
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this one's, unbuffered output, HYDRA_FULL_ERROR as a user has it
    (unset), and `extra`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    if "HYDRA_FULL_ERROR" not in extra:
        env.pop("HYDRA_FULL_ERROR", None)
    return env


def python(
    *args: str | Path, cwd: Path | None = None, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python <args>` (this interpreter: `-m trmoe.X ...`, `-c code`, a driver script) in a fresh process,
    run to its end: its exit code, stdout and stderr."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=child_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(*args: str | Path, cwd: Path | None = None, env: dict | None = None, **popen) -> subprocess.Popen:
    """`python <args>` started in a fresh process and left running (to be signalled, killed or watched);
    stdout and stderr merged into one pipe unless `popen` says otherwise."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
    return subprocess.Popen(
        [sys.executable, *map(str, args)], cwd=cwd, env=child_env() if env is None else env, **popen
    )


def run_cli(
    args: list[str], cwd: Path, timeout: int = 600, module: str = "trmoe.train"
) -> subprocess.CompletedProcess:
    """`python -m <module> ...` (the train app by default) in a fresh process, from `cwd`."""
    return python("-m", module, *args, cwd=cwd, timeout=timeout)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The output of a launched sweep, which must have succeeded."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def metrics_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def cached_logits(model, ids: torch.Tensor, chunks: list[int], pad=None) -> torch.Tensor:
    """The logits of `ids` decoded through a KV cache, `chunks` positions a call (summing to the length)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1], pad)
    out, start = [], 0
    for n in chunks:
        out.append(model.logits(model(ids[:, start : start + n], cache)))
        start += n
    assert start == ids.shape[1] and cache.length == start
    return torch.cat(out, dim=1)


def hf_export_differences(model, out: Path, ids: torch.Tensor) -> tuple[float, float]:
    """`model` exported (python -m trmoe.export's format hf) into the new directory `out` and loaded back by
    transformers: the largest absolute logit difference from trmoe's over `ids` [B, S], in one forward and
    decoding the last 3 positions through the exported model's own cache (fp32)."""
    from transformers import AutoModelForCausalLM

    from trmoe.export import export
    from trmoe.load import LoadedModel

    loaded = LoadedModel(model, model.spec, 0, out.parent / "ckpt" / "step_0", {}, torch.device("cpu"))
    export(loaded, out)
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model.logits(model(ids))
        full = (hf(ids).logits - ours).abs().max().item()
        step = hf(ids[:, :-3], use_cache=True)
        cached = hf(ids[:, -3:-1], cache=step.cache, use_cache=True)
        last = hf(ids[:, -1:], cache=cached.cache, use_cache=True).logits
        decoded = (torch.cat([cached.logits, last], 1) - ours[:, -3:]).abs().max().item()
    return full, decoded


def wait_until(
    condition: Callable[[], bool], what: str, proc: subprocess.Popen, seconds: float = 120
) -> None:
    """Poll `condition` while `proc` runs; fail (with its output) if it ends or time runs out first."""
    deadline = time.monotonic() + seconds
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0] if proc.poll() is not None else ""
            pytest.fail(f"{what}: never happened\n{out[-3000:]}")
        time.sleep(0.02)


def spawn_ranks(worker: Callable, args: tuple, nprocs: int = 2, timeout_s: float = 240.0) -> None:
    """torch.multiprocessing.spawn with a deadline: a hung collective fails the test (and kills its ranks)
    instead of hanging the whole suite."""
    import torch.multiprocessing as mp

    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=2.0):
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            pytest.fail(f"{worker.__name__}: {nprocs} ranks did not finish within {timeout_s:.0f} s")


def module_hooks(model) -> int:
    """Forward (pre-)hooks on the model's modules, and global ones."""
    from torch.nn.modules import module

    on_modules = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return on_modules + len(module._global_forward_hooks) + len(module._global_forward_pre_hooks)


def watch_training(monkeypatch) -> list[dict]:
    """Patches train() to keep, per run: its Objective (`controls`), the hooks on the model at each
    training forward (`hooks`), the grad-enabled runs of block 0's attention (`attention`: a training
    forward, or its recomputation in the backward) and the tokens of every grad-enabled shared-expert SwiGLU
    call (`shared_rows`). Module hooks do not see a recomputation: the functions are wrapped instead."""

    from trmoe.model import moe
    from trmoe.train import trainer
    from trmoe.train.objective import Objective

    runs: list[dict] = []
    real_swiglu = moe.swiglu

    def swiglu(x, w_in, w_out):
        if runs and torch.is_grad_enabled() and any(w_in is w for w in runs[-1]["shared_w_in"]):
            runs[-1]["shared_rows"].append(x.shape[0])
        return real_swiglu(x, w_in, w_out)

    class Watched(Objective):
        def __init__(self, cfg, model, *args, **kwargs):
            super().__init__(cfg, model, *args, **kwargs)
            run = {"controls": self, "hooks": [], "attention": 0, "shared_rows": []}
            run["shared_w_in"] = [b.ffn.shared.w_in for b in model.blocks if b.ffn.shared is not None]
            runs.append(run)
            attention = model.blocks[0].attn.forward

            def counted(*args, **kwargs):
                run["attention"] += torch.is_grad_enabled()
                return attention(*args, **kwargs)

            model.blocks[0].attn.forward = counted

        def forward(self, inputs, targets=None):
            runs[-1]["hooks"].append(module_hooks(self.model))
            return super().forward(inputs, targets)

    monkeypatch.setattr(moe, "swiglu", swiglu)
    monkeypatch.setattr(trainer, "Objective", Watched)
    return runs


# ------------------------------------------------------------------ the resume tests' run (test_resume*.py)


def train_in_process(run_dir: Path, *overrides: str) -> float:
    """The real train() of RESUME_BASE + overrides in this process, the torch thread count kept."""
    import torch

    from trmoe.train.loop import train

    threads = torch.get_num_threads()
    try:
        return train(compose_config(*RESUME_BASE, *overrides), run_dir)
    finally:
        torch.set_num_threads(threads)


def killed_and_resumed(root: Path, arms: dict[str, list[str]]) -> dict[str, Path]:
    """Per arm (its overrides, which save a checkpoint at step 4 of 8 and name the run `r`): an uninterrupted
    run, and a run SIGKILLed in step 6's forward (a forked child) then resumed from its step-4 checkpoint in
    this process: {arm: the uninterrupted run, arm + "/resumed": the resumed one}."""
    import torch

    from trmoe.train.loop import train

    threads = torch.get_num_threads()
    out = {}
    try:
        for arm, args in arms.items():
            base = root / arm / "base"
            train(compose_config(*args), base)
            killed = drive("step:6:forward", root / arm / "killed", *args)
            assert killed.returncode == -9, killed.stderr[-3000:]
            resumed = root / arm / "killed" / "runs" / "r"
            train(compose_config(*args), resumed)
            assert "=== resume from step 4 " in (resumed / "train.log").read_text()
            out[arm], out[arm + "/resumed"] = base, resumed
    finally:
        torch.set_num_threads(threads)
    return out


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file below `path`: a directory nothing has touched digests the same."""
    import hashlib

    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def assert_same_run(run_dir: Path, baseline: Path) -> None:
    """The same final checkpoint (weights and optimizer state) and metrics.csv but its timing columns."""
    import torch

    from trmoe.run.checkpoint import load_checkpoint

    a, b = load_checkpoint(run_dir), load_checkpoint(baseline)
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for name, value in state_a[index].items():
            assert torch.equal(value, state_b[index][name]), (index, name)
    rows_a, rows_b = metrics_rows(run_dir), metrics_rows(baseline)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for column in ra:
            if column not in TIMING_COLUMNS:
                assert ra[column] == rb[column], (ra["step"], column)
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def assert_latest_sane(run_dir: Path) -> None:
    """`latest` is absent or names a checkpoint that verifies (size and CRC32 of every file)."""
    from trmoe.run.checkpoint import CheckpointStore, read_pointer

    directory = run_dir / "checkpoints"
    name = read_pointer(directory)
    if name is not None:
        CheckpointStore(directory).verify(directory / name)


# ------------------------------------------------------------------ shared data, processes and runs

DRIVER = Path(__file__).with_name("resume_driver.py")  # the app with one fault injected (its docstring)

# What a driver child or a rank would import first: a server process imports it once and forks every child
# from it (the distributed modules: what a rank's process group, FSDP2 and its checkpoint load)
FORK_PRELOAD = [
    "resume_driver",
    "trmoe.train.__main__",
    "trmoe.train.loop",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
]


def fork_server():
    """The multiprocessing context whose children are forked from this process's fork server (started at
    the first child, with FORK_PRELOAD imported)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_PRELOAD)
    return context


def start_forked(
    fault: str, argv: list[str], cwd: Path, env: dict[str, str] | None = None, stem: str = "driver"
):
    """A started child forked from the fork server running resume_driver.forked (the train app with `fault`,
    from `cwd`, `env` added, its stdout and stderr in <stem>.stdout and <stem>.stderr): the Process."""
    import resume_driver

    child = fork_server().Process(target=resume_driver.forked, args=(fault, list(argv), str(cwd), env, stem))
    child.start()
    return child


def drive(fault: str, cwd: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python resume_driver.py <fault> <overrides>` from `cwd` (created), as a real child process that dies
    or exits as that command would (returncode -9 for a SIGKILL), its stdout and stderr. The child is forked
    from a multiprocessing fork server that has already imported the training stack: ~4 s of CPU less per
    child than a fresh interpreter, which is not what these tests are about. The child gets the environment
    the server started with (this process's at its first drive)."""
    cwd.mkdir(parents=True, exist_ok=True)
    child = start_forked(fault, list(overrides), cwd)
    child.join(timeout)
    if child.exitcode is None:
        child.kill()
        child.join()
        pytest.fail(f"{fault}: the driver did not finish within {timeout:.0f} s")
    out, err = ((cwd / f"driver.{name}").read_text() for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess([str(DRIVER), fault, *overrides], child.exitcode, out, err)


SYNTH = dict(vocab_size=512, tokenizer="synthetic", tokenizer_sha256=None, eos_id=0, source={"kind": "test"})


def synthetic_tokens(n: int, vocab: int = 512, seed: int = 0, doc_len: int = 37) -> np.ndarray:
    """Ids in [1, vocab) with EOS (0) closing a document every doc_len tokens (the last token is EOS)."""
    tokens = np.random.default_rng(seed).integers(1, vocab, size=n).astype(np.int64)
    tokens[doc_len - 1 :: doc_len] = 0
    tokens[-1] = 0
    return tokens


def make_shard(directory: Path, tokens: np.ndarray, partition: str = "train", **overrides) -> dict:
    meta = {**SYNTH, **overrides}
    documents = int((tokens == meta["eos_id"]).sum()) if meta["eos_id"] is not None else 0
    return write_shard(directory, tokens, partition=partition, documents=documents, **meta)


def edit_index(directory: Path, **changes) -> None:
    path = directory / INDEX_NAME
    index = json.loads(path.read_text())
    index.update(changes)
    path.write_text(json.dumps(index))


TEXT_WORDS = "the model reads a window of tokens and predicts the next one from its experts".split()


def text_documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        f"Note {i}. " + " ".join(rng.choice(TEXT_WORDS, size=int(rng.integers(8, 40)))) + "."
        for i in range(n)
    ]


def descendants(pid: int) -> list[int]:
    """The process ids below `pid` (each child, then its own); one that ends during the walk is left out."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:  # it ended
        return []
    children = []
    for task in tasks:
        try:
            children += [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:  # that thread ended while we read
            continue
    return [d for c in children for d in (c, *descendants(c))]


def run_ranks(run_dir: Path, overrides: list[str], nproc: int, *, torchrun: bool = False) -> None:
    """DISTRIBUTED_TINY + overrides into run_dir (TRMOE_RUN_DIR): nproc CPU ranks (gloo; launch_ranks), or
    (nproc 1) the train app's main(argv) in this process, as `python -m trmoe.train` runs it; the console
    output lands beside it as <name>.console."""
    if nproc == 1:  # nothing here needs a process of its own: the interpreter start-up is saved
        previous = os.environ.get("TRMOE_RUN_DIR")
        os.environ["TRMOE_RUN_DIR"] = str(run_dir)
        try:
            out = cli([*DISTRIBUTED_TINY, *overrides], Path.cwd())
        finally:
            if previous is None:
                del os.environ["TRMOE_RUN_DIR"]
            else:
                os.environ["TRMOE_RUN_DIR"] = previous
    else:
        out = launch_ranks([*DISTRIBUTED_TINY, *overrides], nproc, run_dir, torchrun=torchrun)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir.parent / f"{run_dir.name}.console").write_text(out.stdout + out.stderr)  # what the user saw


def launch_ranks(
    argv: list[str], nproc: int, run_dir: Path, *, torchrun: bool = False, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=<nproc> -m trmoe.train <argv>` into run_dir (TRMOE_RUN_DIR):
    the exit code, and the ranks' stdout and stderr as torchrun's console shows them. With torchrun (the
    run whose console and rank logs test_distributed reads) that very command; otherwise the ranks are real
    processes forked from drive's fork server, each given what torchrun gives a rank (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the same app and gloo process group without
    torchrun's agent and nproc interpreters importing the training stack (~6 s of CPU a launch)."""
    env = {"PYTHONUNBUFFERED": "1", "TRMOE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        return subprocess.run(
            [*cmd, "-m", "trmoe.train", *argv],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    import socket

    with socket.socket() as s:  # a free port for the rendezvous (torchrun --standalone picks one too)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
    env["LOCAL_WORLD_SIZE"] = str(nproc)
    logs = run_dir.parent / f"{run_dir.name}.ranks"
    logs.mkdir(parents=True, exist_ok=True)
    ranks = [
        start_forked(
            "none", argv, Path.cwd(), {**env, "RANK": str(r), "LOCAL_RANK": str(r)}, str(logs / f"rank{r}")
        )
        for r in range(nproc)
    ]
    deadline = time.monotonic() + timeout
    for child in ranks:
        child.join(max(deadline - time.monotonic(), 0))
    hung = [child for child in ranks if child.exitcode is None]
    for child in hung:  # a rank waiting in a collective for one that died
        child.kill()
        child.join()
    code = 124 if hung else next((c.exitcode for c in ranks if c.exitcode), 0)
    out, err = (
        "".join((logs / f"rank{r}.{name}").read_text() for r in range(nproc)) for name in ("stdout", "stderr")
    )
    return subprocess.CompletedProcess(["torchrun", f"--nproc_per_node={nproc}", *argv], code, out, err)


def train_losses(run_dir: Path) -> list[float]:
    """The train_loss of every step after 0 in run_dir/metrics.csv."""
    with open(run_dir / "metrics.csv") as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f) if int(r["step"]) > 0]
