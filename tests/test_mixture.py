"""data=mixture (docs/data.md, Mixtures): two real corpora — CPython's English help texts (`embedded`, read by
index in a shuffled order) and the Python source of the standard library's json and textwrap modules, as a
Parquet file streamed by `fineweb` (a reader with a cursor) — blended 0.8 / 0.2.

- The samples the run reads hold the two sources at 0.8 / 0.2 within one sample (the quotas are exact
  roundings, not draws): every sampled window is found, by its tokens, in exactly one source's training split.
- kill -9 during training, then the same command: bit-identical weights, optimizer state and metrics rows.
- A 2-rank torchrun (gloo) at the same global batch logs the losses of the single-process run.
- metrics.csv has eval_loss/<source> and eval_bpb/<source>; the report tables them per arm.
- Bad weights / sources: one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import random
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_run, cli, compose_config, drive, launch_ranks, metrics_rows, tree_digest
from presets import O200K_NARROW

from trmoe.config.resolve import to_config
from trmoe.data.build import build_data
from trmoe.data.mixture import MixtureSchedule, Weights
from trmoe.data.pipeline import micro_batch_samples
from trmoe.errors import UserError
from trmoe.report.build import build_report
from trmoe.train.loop import train

SEQ = 32


def _code_parquet(path: Path) -> Path:
    """The second corpus: Python source, one document per block between blank lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = []
    for module in (json.decoder, json.encoder, json.scanner, textwrap):
        text = Path(module.__file__).read_text()
        docs += [block.strip() for block in text.split("\n\n") if block.strip()]
    pq.write_table(pa.table({"text": docs}), path, row_group_size=16)
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mix")
    _code_parquet(root / "code.parquet")
    return root


def mixture(root: Path, help_weight: float = 0.8, code_weight: float = 0.2) -> list[str]:
    return [
        "data=mixture",
        f"+data.sources={{help: {{source: embedded, weight: {help_weight}}}, "
        f"code: {{source: fineweb, path: '{root / 'code.parquet'}', weight: {code_weight}}}}}",
        "data.workers=0",
        "data.eval_fraction=0.1",
    ]


RUN = [
    *O200K_NARROW,
    f"trainer.seq_len={SEQ}",
    "trainer.eval_batches=1",
    "hardware=cpu",
    "hardware.threads=1",
    "run.progress=log",
    "run.name=m",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=2",
    "trainer.steps=12",
    "trainer.log_every=3",
    "trainer.eval_every=6",
    "checkpoint.every_steps=4",
]


# ------------------------------------------------------------------------------------------- the schedule


def test_quotas_are_exact_roundings_of_the_weights():
    rng = random.Random(0)
    for _ in range(50):
        S, B = rng.randint(1, 5), rng.randint(1, 40)
        w = [rng.choice([0.0, rng.random()]) for _ in range(S)]
        w[rng.randrange(S)] += 0.1
        sched = MixtureSchedule(Weights(tuple(w), tuple(w)), B, seed=rng.randrange(100))
        share = [x / sum(w) for x in w]
        for s in range(1, 60):
            q = sched.quota(s)
            assert min(q) >= 0 and sum(q) == B
            c = sched.counts(s)
            assert all(abs(c[i] - s * B * share[i]) < 1 + 1e-9 for i in range(S)), (w, B, s, c)
            assert sorted(sched.slots(s).tolist()) == sorted(np.repeat(np.arange(S), q).tolist())
            assert all(ci == 0 for ci, wi in zip(c, w, strict=True) if wi == 0)


def test_a_weight_ramp_moves_the_quotas_between_its_steps():
    sched = MixtureSchedule(Weights((0.9, 0.1), (0.5, 0.5), ramp_start=10, ramp_end=20), 10, seed=0)
    assert [sched.quota(s) for s in (1, 10)] == [[9, 1], [9, 1]]
    assert [sched.quota(s) for s in (20, 30)] == [[5, 5], [5, 5]]
    assert sched.quota(15) == [7, 3]
    assert MixtureSchedule(sched.weights, 10, seed=0).counts(40) == sched.counts(40)  # a pure function


def test_locate_walks_each_source_in_its_own_order():
    sched = MixtureSchedule(Weights((0.7, 0.3), (0.7, 0.3)), 6, seed=3)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for g in range(60):
        i, local = sched.locate(g)
        seen[i].append(local)
    assert seen[0] == list(range(len(seen[0]))) and seen[1] == list(range(len(seen[1])))
    assert len(seen[1]) == 18


# ------------------------------------------------------------------------------------ real corpora, trained


def _windows(tokens) -> set[bytes]:
    tokens = np.asarray(tokens, dtype=np.int64)
    n = (len(tokens) - 1) // SEQ
    return {tokens[j * SEQ : j * SEQ + SEQ + 1].tobytes() for j in range(n)}


def test_sampled_proportions_match_the_weights(corpora):
    """Every sample 12 steps of 2 ranks read (global batch 8: 96 samples) is a window of exactly one
    source's training split; the code source holds 20% of them within one sample (quotas are rounded, not
    drawn)."""
    from trmoe.data.corpus import load_corpus
    from trmoe.data.fineweb import ParquetSource, split_stream_tokens

    cfg = to_config(compose_config(*mixture(corpora), *RUN, "trainer.micro_batch=4"))
    data = build_data(cfg, 200_019, world_size=2)
    try:
        help_windows = _windows(load_corpus("embedded", eval_fraction=0.1, split_seed=0).train.tokens)
        code_tokens, _ = split_stream_tokens(
            ParquetSource(str(corpora / "code.parquet"), "text"), False, 10**9, 0.1, 0
        )
        # the stream wraps around at its end: its windows continue across the pass boundary
        code_windows = _windows(np.concatenate([code_tokens] * 8))
        counts = {"help": 0, "code": 0}
        for step in range(1, 13):
            for rank in range(2):
                for first, count in micro_batch_samples(step, rank, 2, 4, 1):
                    x, y = data.train.batch(first, count)
                    for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
                        key = row.astype(np.int64).tobytes()
                        found = [key in help_windows, key in code_windows]
                        assert sum(found) == 1, (step, rank, first)
                        counts["code" if found[1] else "help"] += 1
    finally:
        data.close()
    total = sum(counts.values())
    assert total == 96
    assert abs(counts["code"] - 0.2 * total) <= 1  # the stated tolerance: one sample of 96
    plan = data.info["plan"]
    assert plan["code"]["samples"] == counts["code"] and plan["help"]["samples"] == counts["help"]


@pytest.fixture(scope="module")
def trained(corpora, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("baseline") / "m"
    threads = torch.get_num_threads()
    try:
        train(compose_config(*mixture(corpora), *RUN, "trainer.micro_batch=8"), run_dir)
    finally:
        torch.set_num_threads(threads)
    return run_dir


def test_per_source_eval_columns_and_epochs_are_recorded(trained):
    rows = metrics_rows(trained)
    evals = [r for r in rows if r["eval_loss"] != "nan"]
    assert [r["step"] for r in evals] == ["0", "6", "12"]
    for r in evals:
        per = {s: float(r[f"eval_loss/{s}"]) for s in ("help", "code")}
        assert all(np.isfinite(v) for v in per.values())
        assert per["help"] != per["code"]
        assert 0 < float(r["eval_bpb/help"]) < 20 and 0 < float(r["eval_bpb/code"]) < 20
        # the overall figure is the token-weighted mean of the two equal-sized held-out sets
        assert min(per.values()) < float(r["eval_loss"]) < max(per.values())
    assert float(evals[-1]["eval_loss/code"]) < float(evals[0]["eval_loss/code"])
    record = json.loads((trained / "run_config.json").read_text())
    plan = record["data"]["plan"]
    assert plan["help"]["samples"] + plan["code"]["samples"] == 12 * 8
    assert plan["code"]["samples"] == round(0.2 * 96)
    assert plan["help"]["epochs"] == pytest.approx(plan["help"]["samples"] / plan["help"]["windows"])
    assert plan["code"]["epochs"] is None  # a stream: its length is not known up front
    assert "eval_loss/code" in record["metrics_columns"]


@pytest.mark.subprocess
@pytest.mark.parametrize("fault, checkpoint", [("step:6:forward", 4), ("step:8:after", 8)])
def test_kill_9_then_resume_is_bit_exact(corpora, trained, tmp_path, fault, checkpoint):
    args = [*mixture(corpora), *RUN, "trainer.micro_batch=8"]
    killed = drive(fault, tmp_path, *args)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_dir = tmp_path / "runs" / "m"
    threads = torch.get_num_threads()
    try:
        train(compose_config(*args), run_dir)
    finally:
        torch.set_num_threads(threads)
    assert f"resumed at step {checkpoint}" in (run_dir / "train.log").read_text()
    assert_same_run(run_dir, trained)


def test_a_weight_change_on_resume_is_refused_unless_forced(corpora, trained, tmp_path):
    run_dir = tmp_path / "m"
    shutil.copytree(trained, run_dir)
    before = sorted(p.name for p in run_dir.rglob("*"))
    changed = [*mixture(corpora, 0.7, 0.3), *RUN, "trainer.micro_batch=8", "trainer.steps=13"]
    with pytest.raises(UserError, match=r"data\.sources\.help\.weight +0\.8 -> 0\.7"):
        train(compose_config(*changed), run_dir)
    assert sorted(p.name for p in run_dir.rglob("*")) == before  # nothing written
    threads = torch.get_num_threads()
    try:
        train(compose_config(*changed, "trainer.force_resume=true"), run_dir)
    finally:
        torch.set_num_threads(threads)
    record = json.loads((run_dir / "run_config.json").read_text())
    assert record["data"]["weights"] == {"help": 0.7, "code": 0.3}
    assert record["resumes"][-1]["forced"]["data.sources.help.weight"] == [0.8, 0.7]


@pytest.mark.subprocess
def test_two_ranks_equal_one_at_the_same_global_batch(corpora, trained, tmp_path):
    run_dir = tmp_path / "ddp"
    # the held-out set is eval_batches x micro_batch windows: 2 x 4 on each rank = the single run's 1 x 8
    argv = [*mixture(corpora), *RUN, "trainer.micro_batch=4", "trainer.eval_batches=2"]
    out = launch_ranks(argv, 2, run_dir, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    single, ddp = metrics_rows(trained), metrics_rows(run_dir)
    assert [r["step"] for r in ddp] == [r["step"] for r in single]
    for column in ("train_loss", "eval_loss", "eval_loss/help", "eval_loss/code"):
        a = [float(r[column]) for r in single]
        b = [float(r[column]) for r in ddp]
        assert b == pytest.approx(a, rel=1e-5, abs=1e-5, nan_ok=True), column


def test_the_report_tables_each_source_per_arm(trained, tmp_path):
    rep = build_report([trained], tmp_path / "report", make_plots=False)
    text = rep.markdown
    assert "## Per-source held-out loss" in text
    final = metrics_rows(trained)[-1]
    for source in ("help", "code"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {source} |"))
        assert f"{float(final[f'eval_loss/{source}']):.4f}" in line
    header = (tmp_path / "report" / "report.csv").read_text().splitlines()[0]
    assert "final_eval_loss/help" in header and "eval_bpb/code" in header


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["+data.sources={a: {source: embedded, weight: -1}}"],
            "data.sources.a.weight=-1.0: must be a finite",
        ),
        (
            ["+data.sources={a: {source: embedded, weight: 0}, b: {source: embedded, weight: 0}}"],
            "at least one source needs a weight > 0",
        ),
        (["+data.sources={a: {source: embedded}}"], "data.sources.a.weight is required"),
        ([], "data=mixture needs at least one source"),
        (
            ["+data.sources={a: {source: random, weight: 1}}"],
            "data.sources.a.source=random: allowed: embedded",
        ),
        (["+data.sources={a: {source: text, weight: 1}}"], "data.sources.a.text_path"),
        (["+data.sources={a: {source: embedded, weight: 1, path: x}}"], "not used by source embedded"),
        (["+data.sources={a: {source: embedded, weight: 1, weight_final: 2}}"], "data.mixture_ramp_start"),
        (["+data.sources={a.b: {source: embedded, weight: 1}}"], "data.sources.a.b"),
        (["+data.sources={a: {source: embedded, weight: nan}}"], "data.sources.a.weight=nan"),
    ],
)
def test_bad_mixtures_are_one_line_exit_2_nothing_written(tmp_path, overrides, message):
    out = cli(["data=mixture", *overrides, "run.name=bad", "hardware=cpu"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not (tmp_path / "runs").exists()


def test_a_source_of_another_tokenizer_is_refused(tmp_path):
    shard = tmp_path / "shard"
    shard.mkdir()
    ids = np.array([5, 6, 7, 1] * 64, dtype="<u2")
    (shard / "tokens.bin").write_bytes(ids.tobytes())
    import hashlib

    index = {
        "format": "trmoe-token-shard", "version": 1, "bin": "tokens.bin", "dtype": "<u2",
        "num_tokens": int(ids.size), "max_token_id": 7, "vocab_size": 8, "eos_id": 1, "tokenizer": "bytes8",
        "tokenizer_sha256": None, "sha256": hashlib.sha256(ids.tobytes()).hexdigest(), "partition": "train",
        "documents": 64, "text_bytes": 0, "source": {},
    }  # fmt: skip
    (shard / "tokens.idx.json").write_text(json.dumps(index))
    out = cli(
        [
            "data=mixture",
            "+data.sources={help: {source: embedded, weight: 1}, "
            f"other: {{source: tokens, path: '{shard}', weight: 1}}}}",
            "data.eval_fraction=0.2",
            "trainer.seq_len=8",
            "trainer.micro_batch=2",
            "run.name=bad",
            "hardware=cpu",
        ],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.sources.other: tokenizer 'bytes8' differs" in lines[0], out.stderr
    assert not (tmp_path / "runs").exists()


def test_the_planner_shows_tokens_and_epochs_per_source(corpora):
    from trmoe.plan.__main__ import render
    from trmoe.plan.build import make_plan

    plan = make_plan([*mixture(corpora), *RUN, "trainer.micro_batch=8", "trainer.steps=400"])
    mix = plan["mixture"]
    assert mix["help"]["samples"] + mix["code"]["samples"] == 400 * 8
    assert mix["code"]["tokens"] == 640 * SEQ  # 20% of 3,200 samples, exactly
    assert mix["help"]["epochs"] == pytest.approx(2560 / mix["help"]["windows"])
    text = render(plan)
    assert "data mixture" in text and f"{mix['help']['epochs']:.2f} epochs" in text


def test_a_data_cursor_mismatch_names_what_differs(corpora, trained, tmp_path):
    """The same sources in another order (no config key differs: the sources are a mapping) read another
    sequence of samples: refused, naming the order with both values, never two bare fingerprints."""
    run_dir = tmp_path / "m"
    shutil.copytree(trained, run_dir)
    before = tree_digest(run_dir)
    help_first = mixture(corpora)
    swapped = [
        *help_first[:1],
        f"+data.sources={{code: {{source: fineweb, path: '{corpora / 'code.parquet'}', weight: 0.2}}, "
        "help: {source: embedded, weight: 0.8}}",
        *help_first[2:],
    ]
    extend = ["trainer.micro_batch=8", "trainer.steps=13", "optimizer.decay_steps=12"]
    with pytest.raises(UserError) as e:
        train(compose_config(*swapped, *RUN, *extend), run_dir)
    said = str(e.value)
    expected = (
        "data cursor: data.sources (in order): the checkpoint's ['help', 'code'], this run's ['code', 'help']"
    )
    assert said.startswith(expected), said
    assert "resume needs the same data" in said and "\n" not in said
    assert tree_digest(run_dir) == before


def test_a_source_moved_with_the_same_bytes_resumes(corpora, trained, tmp_path):
    """Location keys are volatile (docs/data.md): the same Parquet bytes at another path resume; what
    identifies a source is its content."""
    run_dir = tmp_path / "m"
    shutil.copytree(trained, run_dir)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(corpora / "code.parquet", moved / "code.parquet")
    threads = torch.get_num_threads()
    try:
        extend = ["trainer.micro_batch=8", "trainer.steps=13", "optimizer.decay_steps=12"]
        train(compose_config(*mixture(moved), *RUN, *extend), run_dir)
    finally:
        torch.set_num_threads(threads)
    assert "resumed at step 12" in (run_dir / "train.log").read_text()
