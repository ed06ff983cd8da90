"""Downstream evaluation through lm-evaluation-harness: trmoe's model class scores a local multiple-choice
task exactly as log-likelihoods computed by hand from trmoe's model; rolling log-likelihood and generation
requests; `python -m trmoe.eval` writes <run>/eval/<step>.json; `trmoe-lm-eval` runs lm-eval's own task
YAMLs with `--model trmoe` on a run and the harness's `hf` model on its export, alike; bad input is one line
and exit 2."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import cli
from presets import TRAINING_SENTENCES

pytest.importorskip("lm_eval")  # the `eval` extra (make test installs it)

from trmoe.data.tokenizer import EOS_ID, load_o200k  # noqa: E402
from trmoe.eval import run_tasks  # noqa: E402
from trmoe.eval.lm import TRMoELM  # noqa: E402
from trmoe.generate import Sampling, generate  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
TASK = "trmoe_tiny_mc"


def _docs() -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{TASK}.jsonl").read_text().splitlines()]


@torch.no_grad()
def _loglik(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    logp = model.logits(model(ids)).float().log_softmax(-1)[0]
    return sum(logp[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))


def _by_hand(model) -> list[dict]:
    """Per example: each choice's log-likelihood of " <choice>" after the question, acc and acc_norm."""
    enc = load_o200k()
    rows = []
    for doc in _docs():
        context = enc.encode(doc["question"])
        lls = []
        for choice in doc["choices"]:
            whole = enc.encode(doc["question"] + " " + choice)
            assert whole[: len(context)] == context
            lls.append(_loglik(model, context, whole[len(context) :]))
        norm = [ll / len(" " + c) for ll, c in zip(lls, doc["choices"], strict=True)]
        pick = max(range(len(lls)), key=lls.__getitem__)
        pick_norm = max(range(len(norm)), key=norm.__getitem__)
        rows.append(
            {"lls": lls, "acc": float(pick == doc["answer"]), "acc_norm": float(pick_norm == doc["answer"])}
        )
    return rows


@pytest.fixture(scope="module")
def lm(text_run) -> TRMoELM:
    return TRMoELM(run=str(text_run), batch_size=4)


def test_harness_accuracy_equals_the_hand_computation(lm):
    start = time.perf_counter()
    results = run_tasks(lm, [TASK], include_path=str(TASKS), log_samples=True, bootstrap_iters=0)
    seconds = time.perf_counter() - start
    assert "pretty_env_info" not in results  # no `pip list` per call (trmoe.eval._no_machine_report)
    hand = _by_hand(lm.model)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(hand) == 8
    worst = 0.0
    for sample, want in zip(samples, hand, strict=True):
        got = [float(r[0][0]) for r in sample["resps"]]
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want["lls"], strict=True)))
        assert sample["acc"] == want["acc"] and sample["acc_norm"] == want["acc_norm"], sample["doc_id"]
    figures = results["results"][TASK]
    assert figures["acc,none"] == pytest.approx(sum(r["acc"] for r in hand) / len(hand))
    assert figures["acc_norm,none"] == pytest.approx(sum(r["acc_norm"] for r in hand) / len(hand))
    assert figures["acc,none"] >= 0.5  # the model learnt the sentences most questions are about
    print(
        f"{TASK}: acc {figures['acc,none']:.3f}, acc_norm {figures['acc_norm,none']:.3f}, "
        f"{seconds:.1f} s; max |harness - hand| log-likelihood {worst:.2e}"
    )
    assert worst < 1e-4


def test_rolling_loglikelihood_and_generation(lm):
    from lm_eval.api.instance import Instance

    text = "The cat sat on the mat and looked at the red ball."
    req = Instance("loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (rolling,) = lm.loglikelihood_rolling([req])
    ids = load_o200k().encode(text)
    assert rolling == pytest.approx(_loglik(lm.model, [EOS_ID], ids), abs=1e-4)
    # a window shorter than the text: the harness's disjoint windows still cover every token once
    lm_short = TRMoELM(model=lm.model, max_length=5, batch_size=2)
    (windowed,) = lm_short.loglikelihood_rolling([req])
    assert windowed < 0 and len(ids) > 5
    prompts = ["The cat sat on", "Water boils at"]
    reqs = [
        Instance("generate_until", doc={}, arguments=(p, {"until": ["."], "max_gen_toks": 12}), idx=i)
        for i, p in enumerate(prompts)
    ]
    outs = lm.generate_until(reqs)
    enc = load_o200k()
    for prompt, out in zip(prompts, outs, strict=True):
        (new,) = generate(lm.model, [enc.encode(prompt)], Sampling(12, greedy=True), eos_id=EOS_ID)
        assert out == enc.decode([t for t in new if t != EOS_ID]).split(".")[0]
        assert "." not in out


def _scored_on(stderr, lm, monkeypatch) -> None:
    """Score 8 loglikelihood requests (tiny_mc's first question's choices, twice) with sys.stderr
    replaced by `stderr`, as tqdm reads it when the bar is made."""
    from lm_eval.api.instance import Instance

    monkeypatch.setattr(sys, "stderr", stderr)
    doc = _docs()[0]
    reqs = [
        Instance("loglikelihood", doc={}, arguments=(doc["question"], " " + c), idx=i)
        for i, c in enumerate(doc["choices"] * 2)
    ][:8]
    assert len(lm.loglikelihood(reqs)) == len(reqs)
    stderr.flush()


def _drawn_on_a_terminal(lm, monkeypatch) -> str:
    """What scoring wrote to a real pseudo-terminal as its stderr."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    # a terminal's size, as a real one has (a new pty is 0 columns wide: tqdm would draw an empty line)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        with os.fdopen(slave, "w") as terminal:
            _scored_on(terminal, lm, monkeypatch)
        os.set_blocking(master, False)
        chunks = []  # a pty hands its buffer over in pieces: read until it is empty
        while True:
            try:
                chunk = os.read(master, 65536)
            except (BlockingIOError, OSError):  # drained (EIO: the writer's side is closed)
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)


BAR = re.compile(r"trmoe loglikelihood: 100%.*\b(\d+)/\1 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+ ?(req/s|s/req)\]")


def test_scoring_draws_a_bar_on_a_terminal_only(lm, monkeypatch, tmp_path):
    """Old code: `--model trmoe` scored every request in silence. On a real pseudo-terminal: requests done /
    total, elapsed < remaining (the ETA) and the rate; on a file: no bar of ours (a log gets no bar lines);
    none with progress=False (training's downstream columns) even on a terminal."""
    drawn = _drawn_on_a_terminal(lm, monkeypatch)
    assert BAR.search(drawn) and "8/8" in drawn, drawn
    with open(tmp_path / "log", "w") as log:
        _scored_on(log, lm, monkeypatch)
    # (the harness's own "Tokenizing inputs" bar is written there either way: not trmoe's to silence)
    assert "trmoe" not in (tmp_path / "log").read_text()
    assert "trmoe" not in _drawn_on_a_terminal(
        TRMoELM(model=lm.model, batch_size=4, progress=False), monkeypatch
    )


def test_eval_cli_writes_results_adds_later_tasks_and_never_overwrites(text_run, tmp_path):
    """A second evaluation of the same step (README's two lines) adds its tasks to eval/<step>.json; a task
    already there, or another limit, is one line and the file is left as it was."""
    tasks = shutil.copytree(TASKS, tmp_path / "tasks")
    other = "trmoe_tiny_mc_again"
    yaml_text = (tasks / f"{TASK}.yaml").read_text().replace(f"task: {TASK}", f"task: {other}")
    (tasks / f"{other}.yaml").write_text(yaml_text)
    args = [f"run={text_run}", f"include_path={tasks}", "batch_size=4"]
    result = cli([*args, f"tasks=[{TASK}]"], cwd=tmp_path, module="trmoe.eval")
    assert result.returncode == 0, result.stderr[-3000:]
    file = text_run / "eval" / "60.json"
    record = json.loads(file.read_text())
    assert record["step"] == 60 and list(record["results"]) == [TASK] and record["tasks"] == [TASK]
    assert record["num_fewshot"] is None and record["limit"] is None  # what the figures were made with
    print(f"python -m trmoe.eval on {TASK} (8 examples): {record['seconds']:.1f} s inside the harness")
    try:
        again = cli([*args, f"tasks=[{TASK}]"], cwd=tmp_path, module="trmoe.eval")
        assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
        assert f"tasks: {TASK}: already in {file} (nothing is overwritten)" in again.stderr
        limited = cli([*args, f"tasks=[{other}]", "limit=2"], cwd=tmp_path, module="trmoe.eval")
        assert limited.returncode == 2 and "limit=2: " in limited.stderr, limited.stderr
        assert json.loads(file.read_text()) == record
        added = cli([*args, f"tasks=[{other}]"], cwd=tmp_path, module="trmoe.eval")
        assert added.returncode == 0, added.stderr[-3000:]
        both = json.loads(file.read_text())
        assert both["tasks"] == [TASK, other] and list(both["results"]) == [TASK, other]
        assert both["results"][TASK] == record["results"][TASK]
        assert both["results"][other]["acc,none"] == record["results"][TASK]["acc,none"]  # the same data
    finally:
        shutil.rmtree(text_run / "eval")  # the run is shared by the session's other tests


def _lambada_local(folder: Path) -> Path:
    """lm-eval's own lambada_openai task YAML, with its data location overridden to a local JSONL file of the
    training sentences (the task's prompts, target and metrics are the harness's)."""
    import lm_eval

    own = Path(lm_eval.__file__).parent / "tasks" / "lambada" / "lambada_openai.yaml"
    folder.mkdir()
    data = folder / "lambada_local.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in TRAINING_SENTENCES))
    (folder / "lambada_local.yaml").write_text(
        f"include: {own}\ntask: lambada_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
    )
    return folder


def test_the_harness_command_line_knows_every_model_and_trmoe(text_run, exported, tmp_path):
    """`trmoe-lm-eval` (the harness's own CLI): `--model trmoe` on a run and `--model hf` on its export score
    lm-eval's own lambada_openai YAML (data overridden to local files) alike; a bad step is one line."""
    tasks = _lambada_local(tmp_path / "tasks")
    common = ["--tasks", "lambada_local", "--include_path", str(tasks), "--batch_size", "4"]
    ours = cli(
        ["--model", "trmoe", "--model_args", f"run={text_run},step=60", *common, "--output_path", "ours"],
        cwd=tmp_path,
        module="trmoe.eval.harness",
    )
    assert ours.returncode == 0, ours.stderr[-3000:]
    theirs = cli(
        [
            "--model",
            "hf",
            "--model_args",
            f"pretrained={exported},trust_remote_code=True,dtype=float32",
            "--device",
            "cpu",
            *common,
            "--output_path",
            "theirs",
        ],
        cwd=tmp_path,
        module="trmoe.eval.harness",
    )
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    figures = [
        json.loads(next((tmp_path / name).rglob("results_*.json")).read_text())["results"]["lambada_local"]
        for name in ("ours", "theirs")
    ]
    assert figures[0]["acc,none"] == figures[1]["acc,none"]
    assert figures[0]["perplexity,none"] == pytest.approx(figures[1]["perplexity,none"], rel=1e-3)
    # the harness's own results file, as lm_eval writes it: the machine's description included
    assert "pretty_env_info" in json.loads(next((tmp_path / "ours").rglob("results_*.json")).read_text())
    # run and step are checked before the harness indexes its tasks: nothing of it runs (its first log line)
    for step, line in (("7", "trmoe: step=7: "), ("x", "trmoe: step=x: not an integer")):
        bad = cli(
            ["--model", "trmoe", "--model_args", f"run={text_run},step={step}", *common],
            cwd=tmp_path,
            module="trmoe.eval.harness",
        )
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [bad.stderr.strip()], bad.stderr
        assert bad.stderr.startswith(line), bad.stderr


@pytest.mark.subprocess
def test_the_readme_lm_eval_line_offline_is_one_line(text_run, tmp_path):
    """README's `trmoe-lm-eval --model trmoe --model_args run=...,step=... --tasks arc_easy` on a machine
    without arc_easy's data (offline: trmoe.eval turns the hub off) ended in a 59-line traceback; a console
    shows the harness's log lines and then one line, exit 2, as trmoe-eval gives it."""
    from helpers import python

    args = ["--model", "trmoe", "--model_args", f"run={text_run},step=60", "--tasks", "arc_easy"]
    result = python("-m", "trmoe.eval.harness", *args, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("trmoe: lm-eval: --tasks arc_easy: a task's data is not available offline ("), last
    assert last.endswith("or local task YAMLs (--include_path)") and "datasets cache" in last, last


def test_help_lists_the_keys_and_their_defaults(tmp_path):
    result = cli(["--help"], cwd=tmp_path, module="trmoe.eval")
    assert result.returncode == 0
    for key in ("run=(required)", "tasks=[]", "batch_size=8", "device=auto", "include_path=null"):
        assert key in result.stdout, key


def test_bad_input_is_one_line_and_exit_2(text_run, tmp_path, tmpfs, capsys):
    from trmoe.eval.__main__ import main

    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)  # a read-only place for the results
    (tmp_path / "file").write_text("in the way")
    task = [f"tasks=[{TASK}]", f"include_path={TASKS}"]
    cases = [
        ([f"run={text_run}", *task, f"out={tmpfs}/r.json"], f"out={tmpfs}/r.json: {tmpfs} is not writable"),
        ([f"run={text_run}", *task, f"out={tmp_path}/file/r.json"], f"{tmp_path}/file is a file, not a"),
        ([f"run={text_run}", "tasks=[no_such_task_xyz]"], "unknown task 'no_such_task_xyz'"),
        ([f"run={text_run}", "tasks=[arc_easy]"], "arc_easy: its data is not available offline"),
        ([f"run={tmp_path}", f"tasks=[{TASK}]", f"include_path={TASKS}"], "holds no checkpoint"),
        ([f"run={text_run}", "tasks=[]"], "tasks: empty"),
        ([f"run={text_run}", f"tasks=[{TASK}]", "include_path=/no/such/dir"], "include_path"),
        ([f"run={text_run}", "nonsense=1"], "nonsense"),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        code = main(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "eval").exists() and list(tmpfs.iterdir()) == []


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("limit=-1", "limit=-1: must be a positive integer"),
        ("limit=0", "limit=0: must be a positive integer"),
        ("batch_size=0", "batch_size=0: must be a positive integer"),
        ("num_fewshot=-1", "num_fewshot=-1: must be an integer >= 0"),
        ("step=-3", "step=-3: must be an integer >= 0"),
        ("dtype=fp8", "dtype=fp8: allowed: auto, fp32, bf16, fp16"),
        ("device=tpu", "device=tpu: allowed: auto, cpu"),
        # Hydra said "str is not a ListConfig" after a doubled prefix
        (
            "tasks=arc_easy",
            "trmoe: eval: config error: tasks=arc_easy: tasks is a list; write tasks=[arc_easy]",
        ),
        pytest.param(
            "device=cuda",
            "device=cuda: CUDA is not available here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: device=cuda is valid"),
        ),
    ],
)
def test_eval_keys_are_validated_before_anything_runs(tmp_path, key, expected):
    """The tool's keys are checked as training checks downstream.*: one line, exit 2, nothing written (the
    checks come before the run directory is even read, so an empty one does here)."""
    result = cli([f"run={tmp_path}", f"tasks=[{TASK}]", f"include_path={TASKS}", key], tmp_path, "trmoe.eval")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_task_gets_a_close_name_before_the_harness_indexes_its_own(tmp_path, monkeypatch):
    """A misspelt task is refused with the close names, from a read of the harness's task files, before its
    first full indexing (a minute on a slow disk): no index is built (none is cached)."""
    from trmoe.errors import UserError
    from trmoe.eval import load_tasks

    monkeypatch.setenv("TRMOE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(UserError) as refused:
        load_tasks(["arc_easyy"])
    assert "unknown task 'arc_easyy'; did you mean arc_easy" in str(refused.value), refused.value
    assert not (tmp_path / "cache").exists()  # refused before the harness's index was built (and cached)


def test_the_task_index_is_kept_on_disk_and_never_stale(tmp_path, monkeypatch):
    """trmoe.eval.task_index on a small folder standing in for the harness's own: the manager equals the
    harness's TaskManager over the same folders (tasks, groups, tags; an include_path task overrides a
    default of its name); a second manager reads the file (an entry taken out of it is missing), an
    unreadable file is written again; a task added, edited or removed is seen at once, one file is kept; an
    index JSON cannot hold is not cached."""
    from lm_eval.tasks import TaskManager

    from trmoe.eval import task_index

    monkeypatch.setenv("TRMOE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "defaults"
    folder.mkdir()

    def task(name: str, extra: str = "") -> None:  # the local task under another name, tagged
        text = f"include: {TASKS / TASK}.yaml\ntask: {name}\ntag: [letters]\n{extra}"
        (folder / f"{name}.yaml").write_text(text)

    task("a_mc"), task("b_mc"), task(TASK)  # TASK: include_path's task of that name wins
    (folder / "both.yaml").write_text("group: both\ntask: [a_mc, b_mc]\n")

    class Small(task_index.CachedTaskManager):
        defaults = folder

    def same_as_the_harness(ours: TaskManager) -> None:
        theirs = TaskManager(include_path=[str(folder), str(TASKS)], include_defaults=False)
        for attr in ("all_tasks", "all_subtasks", "all_groups", "all_tags", "task_index"):
            assert getattr(ours, attr) == getattr(theirs, attr), attr

    same_as_the_harness(Small(include_path=str(TASKS)))
    (cached,) = (tmp_path / "cache").glob("lm_eval_tasks-*.json")
    stored = json.loads(cached.read_text())
    del stored["entries"]["b_mc"]
    cached.write_text(json.dumps(stored))
    assert "b_mc" not in Small().all_tasks and "a_mc" in Small().all_tasks  # read from the file
    cached.write_text("{not json")  # unreadable: indexed again and written again
    assert "b_mc" in Small().all_tasks and "b_mc" in json.loads(cached.read_text())["entries"]
    stored = json.loads(cached.read_text())  # an entry whose YAML no longer exists: never trusted
    stored["entries"]["b_mc"][2] = str(tmp_path / "gone" / "b_mc.yaml")
    cached.write_text(json.dumps(stored))
    assert Small().task_index["b_mc"].yaml_path == folder / "b_mc.yaml"  # indexed again
    assert json.loads(cached.read_text())["entries"]["b_mc"][2] == str(folder / "b_mc.yaml")  # written again
    task("c_mc")  # added
    assert {"b_mc", "c_mc"} <= set(Small().all_tasks)
    task("c_mc", "metadata: {note: edited}\n")  # edited (its size)
    assert Small().task_index["c_mc"].cfg["metadata"] == {"note": "edited"}
    (folder / "a_mc.yaml").unlink()  # removed
    manager = Small(include_path=str(TASKS))
    assert "a_mc" not in manager.all_tasks
    same_as_the_harness(manager)
    assert len(list((tmp_path / "cache").glob("lm_eval_tasks-*.json"))) == 1
    task("d_mc", "metadata: {released: 2024-01-02}\n")  # a YAML date: JSON has none
    assert "d_mc" in Small().all_tasks
    assert list((tmp_path / "cache").glob("lm_eval_tasks-*.json")) == []  # the old key's file is stale


def test_the_cache_folder_follows_xdg(tmp_path, monkeypatch):
    from trmoe.eval.task_index import cache_dir

    monkeypatch.delenv("TRMOE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "trmoe"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "trmoe"
    monkeypatch.setenv("TRMOE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
