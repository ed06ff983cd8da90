"""The benchmarks run and record what docs/performance.md reads from them (tiny sizes: no timing is
asserted, only that each result line is complete and its ratios are the ratios of its own timings)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from trmoe.bench import dispatch, ffn, step
from trmoe.bench.common import LayerBench, layer_args


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


def test_only_ffn_takes_compile(capsys):
    assert layer_args("ffn", None, ["--compile"], compiles=True).compile
    assert not layer_args("ffn", None, [], compiles=True).compile
    with pytest.raises(SystemExit) as stop:
        layer_args("dispatch", None, ["--compile"])
    assert stop.value.code == 2 and "unrecognized arguments: --compile" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("TRMOE_SLOW_TESTS"), reason="inductor on CPU compiles for ~1.5 min")
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
