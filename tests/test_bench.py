"""The benchmarks run and record what docs/performance.md reads from them (tiny sizes: no timing is
asserted, only that each result line is complete and its ratios are the ratios of its own timings), and
turn bad input away with one line and exit code 2 before they run or record anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import cli, run_cli

from trmoe.bench import dispatch, ffn, step
from trmoe.bench.common import LayerBench, layer_args
from trmoe.errors import UserError


@pytest.fixture
def results(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    monkeypatch.setenv("TRMOE_RESULTS", str(path))
    # the benchmarks set the process up as a training run does (threads, deterministic mode): put it back
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    yield lambda: [json.loads(line) for line in path.read_text().splitlines()]
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def test_ffn_and_dispatch_record_a_line_per_layout(results):
    ffn.run(LayerBench(tokens=64, reps=1))
    dispatch.run(LayerBench(tokens=64, reps=1))
    lines = results()
    assert [(r["bench"], r["layout"]) for r in lines] == [
        (b, layout) for b in ("ffn", "dispatch") for layout in ffn.LAYOUTS
    ]
    for r in lines:
        assert r["machine"]["torch"] == torch.__version__ and r["dtype"] == "float32"
    for r in lines[:3]:
        t = r["timings"]
        assert r["ratio_vs_dense_stored"] == t["tr"]["median_s"] / t["dense_stored"]["median_s"]
        # one round (reps=1): the paired ratio is that round's, the same as the medians'
        assert r["paired_ratio_vs_dense_active"] == pytest.approx(r["ratio_vs_dense_active"])
        assert t["tr"]["samples_s"] == [t["tr"]["median_s"]]
        assert r["active_width"] == r["shared_width"] + r["top_k"] * r["routed_width"] // r["experts"]


def test_only_ffn_takes_compile():
    assert layer_args("ffn", None, ["--compile"], compiles=True).compile
    assert not layer_args("ffn", None, [], compiles=True).compile
    with pytest.raises(UserError, match="bench dispatch: unrecognized arguments: --compile"):
        layer_args("dispatch", None, ["--compile"])


TINY_LOSS = ["--tokens", "8", "--hidden", "4", "--kinds", "full"]
BAD_INPUTS = [  # (command line after `python -m trmoe.bench`, what its one line must name)
    (["nope"], ["'nope'", "'ffn', 'dispatch', 'loss', 'step', 'data'"]),
    (["ffn", "--tokens", "0"], ["bench ffn", "--tokens", "'0'", ">= 1"]),
    (["ffn", "--reps", "-5"], ["--reps", "'-5'", ">= 1"]),
    (["ffn", "--dtype", "float99"], ["--dtype", "'float99'", "'float32', 'bfloat16'"]),
    (["dispatch", "--device", "bogus"], ["bench dispatch", "--device", "'bogus'", "'cpu'"]),
    (["dispatch", "--strategy", "bogus"], ["--strategy", "'bogus'", "'modulo_cyclic'", "'random'"]),
    (["dispatch", "--compile"], ["--compile", "python -m trmoe.bench dispatch --help"]),
    (["loss", "--kinds", "chunked", "bogus"], ["bench loss", "--kinds", "'bogus'", "'chunked', 'torch'"]),
    (["step", "--model", "nope"], ["bench step", "--model", "'nope'", "'tiny'"]),
    (["step", "--batch", "0"], ["--batch", "'0'", ">= 1"]),
    (["step", "--steps", "0"], ["--steps", "'0'", ">= 1"]),
    (["step", "--model", "tiny", "--seq", "99999"], ["trainer.seq_len=99999", "model.max_seq_len"]),
    (
        ["step", "--model", "tiny", "--steps", "1", "bogus.key=1"],
        ["config error", "bogus: the config has no such key"],
    ),
    # a list would benchmark (and record) a merged config; a number is Hydra's ValueError
    (
        ["step", "--model", "tiny", "--steps", "1", "attention=[gqa,mha]"],
        ["attention group takes one option", "gqa, mha"],
    ),
    (["step", "--model", "tiny", "--steps", "1", "model=5"], ["model=5", "model group takes one option"]),
    (["step", "--model", "tiny", "--steps", "1", "model=nope"], ["model/nope", "allowed: 100m"]),
    (["data", "--workers", "0,-1"], ["bench data", "--workers", "'0,-1'", ">= 0"]),
    (["data", "--dir", "a_file"], ["--dir", "'a_file'", "a directory"]),
    # nan would never skip the full logits, -1 always (small sizes: a missing check runs them)
    (["loss", "--max-gb", "nan", *TINY_LOSS], ["bench loss", "--max-gb", "'nan'", "a finite number > 0"]),
    (["loss", "--max-gb", "-1", *TINY_LOSS], ["--max-gb", "'-1'", "a finite number > 0"]),
    # the train app's device selection: no CPU measurement recorded as hardware=cuda
    (
        ["step", "--device", "cpu", "hardware=cuda", "--model", "tiny", "--steps", "1", "--seq", "32"],
        ["config error", "hardware", "cuda"],
    ),
]
IDS = [" ".join(argv) for argv, _ in BAD_INPUTS]
# through the real command line as well (a fresh interpreter importing torch each, ~2 s of CPU): the
# benchmark name, an argparse type, a config check of `step`, a path
BY_CLI = ["nope", "ffn --tokens 0", "step --model tiny --seq 99999", "data --dir a_file"]


def _assert_one_line(code: int, out: str, err: str, names: list[str], results) -> None:
    assert code == 2, err
    (line,) = err.splitlines()  # one line: no traceback, no usage block
    assert line.startswith("trmoe: ") and all(name in line for name in names), line
    assert out == "" and not results.exists()  # nothing measured, nothing recorded


@pytest.mark.parametrize(("argv", "names"), BAD_INPUTS, ids=IDS)
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(argv, names, tmp_path, monkeypatch, capsys):
    from trmoe.bench.__main__ import main

    monkeypatch.setenv("TRMOE_RESULTS", str(tmp_path / "results.jsonl"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a directory\n")
    code = main(argv)
    _assert_one_line(code, *capsys.readouterr(), names, tmp_path / "results.jsonl")


@pytest.mark.parametrize("where", ["TRMOE_RESULTS=<a directory>", "a file named bench in the cwd"])
def test_an_unwritable_results_path_is_refused_before_the_benchmark(where, tmp_path, monkeypatch, capsys):
    from trmoe.bench.__main__ import main

    monkeypatch.chdir(tmp_path)
    if where.startswith("TRMOE_RESULTS"):
        monkeypatch.setenv("TRMOE_RESULTS", str(tmp_path))
        names = [f"TRMOE_RESULTS={tmp_path} is a directory"]
    else:
        monkeypatch.delenv("TRMOE_RESULTS", raising=False)
        (tmp_path / "bench").write_text("mine\n")
        names = ["results file bench/results.jsonl: bench is a file, not a directory"]
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["ffn", "--tokens", "8", "--reps", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err  # nothing measured
    (line,) = err.splitlines()
    assert line.startswith("trmoe: bench: ") and all(name in line for name in names), line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["routing.top_k=9"], ["config error", "routing.top_k=9"]),
        (["trainer.steps=abc"], ["config error", "trainer.steps=abc"]),
        (["--steps", "0"], ["--steps", "'0'", ">= 1"]),  # was a StatisticsError
        (["--log-every", "0"], ["--log-every", "'0'", ">= 1"]),  # was a ZeroDivisionError
        (["--block", "0"], ["--block", "'0'", ">= 1"]),  # looped forever
    ],
)
def test_telemetry_overhead_refuses_bad_input_in_one_line(argv, names, capsys):
    from trmoe.tools.telemetry_overhead import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert out == "" and line.startswith("trmoe: ") and all(name in line for name in names), line


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """`python -m trmoe.bench` on each command line of BY_CLI, all started at once, in a scratch directory,
    each with a TRMOE_RESULTS of its own."""
    root = tmp_path_factory.mktemp("bench-cli")
    (root / "a_file").write_text("not a directory\n")
    runs = {}
    for i, line in enumerate(BY_CLI):
        results = root / f"results-{i}" / "results.jsonl"
        env = {**os.environ, "TRMOE_RESULTS": str(results)}
        command = [sys.executable, "-m", "trmoe.bench", *line.split()]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        runs[line] = subprocess.Popen(command, cwd=root, env=env, **pipes), results
    yield runs
    for proc, _ in runs.values():
        proc.kill()
        proc.communicate()


@pytest.mark.subprocess
@pytest.mark.parametrize("line", BY_CLI)
def test_bad_input_on_the_command_line(cli_runs, line):
    proc, results = cli_runs[line]
    out, err = proc.communicate(timeout=120)
    _assert_one_line(proc.returncode, out, err, BAD_INPUTS[IDS.index(line)][1], results)


@pytest.mark.slow(opt_in="inductor on CPU compiles for ~1.5 min")
def test_ffn_compiled_records_its_timings(results):
    ffn.run(LayerBench(tokens=64, reps=1, dtype="bfloat16", compile=True))
    lines = results()
    assert [r["layout"] for r in lines] == list(ffn.LAYOUTS)
    assert all(r["compile"] and set(r["timings"]) == {"tr", "dense_stored", "dense_active"} for r in lines)


def test_step_pairs_the_arms_and_counts_flops(results, monkeypatch):
    monkeypatch.setattr("sys.argv", ["x"])
    step.main(
        ["--model", "tiny", "--steps", "1", "--seq", "32", "--pair", "data=random", "model.vocab_size=512"]
    )
    (line,) = results()
    tr, dense = line["tr"], line["dense"]
    assert tr["params_total"] == dense["params_total"] and tr["params_active"] < dense["params_active"]
    assert line["tr_over_dense_tok_s"] == pytest.approx(tr["tok_s"] / dense["tok_s"])
    # one measured round (--steps 1): its paired ratio is the same as the medians'
    assert len(tr["step_s_each"]) == len(dense["step_s_each"]) == 1
    assert line["tr_over_dense_rounds"] == [pytest.approx(dense["step_s_each"][0] / tr["step_s_each"][0])]
    assert line["tr_over_dense_rounds"][0] == pytest.approx(line["tr_over_dense_tok_s"])
    assert tr["tok_s"] == pytest.approx(32 / sum(tr["split_s"].values()))
    assert 0 < tr["mfu"] == pytest.approx(tr["achieved_flops"] / line["peak_flops"])


@pytest.mark.subprocess  # the peak memory of each backend is measured against a fresh process's baseline
def test_loss_measures_each_backend_in_its_own_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TRMOE_RESULTS", str(tmp_path / "results.jsonl"))
    args = ["loss", "--tokens", "64", "--hidden", "16", "--chunk", "32", "--kinds", "chunked", "full"]
    out = run_cli(args, tmp_path, timeout=300, module="trmoe.bench")
    assert out.returncode == 0, out.stderr[-2000:]
    chunked, full = (json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines())
    assert (chunked["kind"], chunked["backend"], full["kind"]) == ("chunked", "chunked", "full")
    assert chunked["chunked_bound_bytes"] == 2 * 32 * 200_019 * 4 and chunked["seconds"] > 0
    # the full path holds the [64, V] fp32 logits and their gradient at once; the chunked one 32 rows
    assert full["extra_peak_bytes"] > 2 * 64 * 200_019 * 4 > chunked["extra_peak_bytes"]


def test_data_times_reads_prepare_and_the_stream(tmp_path, monkeypatch):
    monkeypatch.setenv("TRMOE_RESULTS", str(tmp_path / "results.jsonl"))
    # --dir holds the user's own files under the names the benchmark writes: they stay as they are
    scratch = tmp_path / "scratch"
    mine = {"corpus.txt": "my corpus\n", "shard": "my shard\n", "pq/part-0.parquet": "my table\n"}
    for name, text in mine.items():
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        (scratch / name).write_text(text)
    args = ["data", "--shard-mb", "1", "--text-mb", "1", "--reps", "1", "--micro-batch", "2"]
    args += ["--seq-len", "64", "--workers", "0,1", "--dir", str(scratch)]
    out = cli(args, tmp_path, module="trmoe.bench")
    assert out.returncode == 0, out.stderr[-2000:]
    left = {str(p.relative_to(scratch)) for p in scratch.rglob("*") if p.is_file()}
    assert left == set(mine) and all((scratch / n).read_text() == t for n, t in mine.items())
    assert sorted(p.name for p in scratch.iterdir()) == ["corpus.txt", "pq", "shard"]  # its own dir removed
    (line,) = (json.loads(text) for text in (tmp_path / "results.jsonl").read_text().splitlines())
    assert line["bench"] == "data" and line["shard"]["shard_tokens"] == 2**20 // 4
    assert set(line["prepare"]["prepare"]) == set(line["stream"]) == {"0", "1"}
    assert all(r["tokens_per_s"] > 0 for r in line["stream"].values())
    prepared = line["prepare"]
    assert prepared["tokens"] > 0 and set(prepared["pool_start_s"]) == {"1"}
    for r in prepared["prepare"].values():  # each rate is the tokens prepared over its own time
        assert r["tokens_per_s"] * r["seconds"] == pytest.approx(prepared["tokens"])


def test_decode_records_kv_cache_and_recompute_speed(results):
    from trmoe.bench import decode

    decode.main(
        ["--models", "tiny", "--batch", "1,2", "--new-tokens", "2", "--prompt-tokens", "3", "--reps", "1"]
    )
    lines = results()
    assert [(r["bench"], r["model"], r["batch"]) for r in lines] == [
        ("decode", "tiny", 1),
        ("decode", "tiny", 2),
    ]
    for r in lines:
        t = r["timings"]
        assert r["tok_s"]["kv_cache"] == pytest.approx(r["batch"] * 2 / t["kv_cache"]["median_s"])
        assert r["speedup"] == pytest.approx(t["recompute"]["samples_s"][0] / t["kv_cache"]["samples_s"][0])
    with pytest.raises(UserError, match="--batch"):
        decode.main(["--batch", "0"])
