"""tokenizer=bpe: a small byte-level BPE trained by `python -m trmoe.data.prepare --tokenizer bpe --vocab-size
N` (trmoe.data.bpe), read by every tool: deterministic training, the shards and runs that record it, the
model built over its vocabulary, sample / export / lm-eval / report on a run of it, and the one-line refusals
(a bad --vocab-size, a missing file, shards of another tokenizer). The tools' own entry points, real files."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, compose_config

from trmoe.data.bpe import MIN_VOCAB, BPETokenizer, train_bpe
from trmoe.data.corpus import embedded_documents
from trmoe.errors import UserError

VOCAB = 512
TASKS = Path(__file__).parent / "lm_eval_tasks"
TRAIN = [
    "model=tiny",
    "hardware=cpu",
    "hardware.threads=1",
    "run.progress=log",
    "trainer.seq_len=32",
    "trainer.micro_batch=4",
    "trainer.steps=6",
    "trainer.eval_every=3",
    "trainer.eval_batches=1",
    "trainer.log_every=3",
]


def _prepare(out: Path, *extra: str, cwd: Path):
    args = ["--embedded", "--tokenizer", "bpe", "--eval-fraction", "0.1", "--workers", "0", "--out", str(out)]
    return cli([*args, *extra], cwd=cwd, module="trmoe.data.prepare")


def _one_line(result, expected: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and expected in lines[-1], result.stderr


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bpe")
    result = _prepare(root / "data", "--vocab-size", str(VOCAB), cwd=root)
    assert result.returncode == 0, result.stderr
    return root / "data"


@pytest.fixture(scope="module")
def bpe_run(dataset, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bpe_run")
    result = cli([*TRAIN, "data=tokens", f"data.path={dataset}", "tokenizer=bpe", "run.name=r"], cwd=root)
    assert result.returncode == 0, result.stderr
    return root / "runs" / "r"


def test_training_is_deterministic_and_sized_exactly():
    docs = [text for _, text in embedded_documents()]
    a, b = train_bpe(docs, VOCAB), train_bpe(list(docs), VOCAB)
    assert a == b  # same documents in the same order, same N: the same bytes
    assert train_bpe(docs, VOCAB + 1) != a


def test_prepare_writes_the_tokenizer_beside_the_shards_byte_identically(dataset, tmp_path):
    again = _prepare(tmp_path / "again", "--vocab-size", str(VOCAB), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "tokenizer=bpe" in again.stdout  # the printed training command selects it
    for name in ("tokenizer.json", "train/tokens.bin", "eval/tokens.bin", "token_counts.npy"):
        assert (dataset / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    sha = hashlib.sha256((dataset / "tokenizer.json").read_bytes()).hexdigest()
    summary = json.loads((dataset / "dataset.json").read_text())
    assert (summary["tokenizer"], summary["tokenizer_sha256"], summary["vocab_size"]) == ("bpe", sha, VOCAB)
    assert summary["source"]["inputs"][0]["path"].startswith("embedded")
    tok = BPETokenizer(dataset / "tokenizer.json")
    for part in ("train", "eval"):
        index = json.loads((dataset / part / "tokens.idx.json").read_text())
        assert (index["tokenizer"], index["tokenizer_sha256"], index["vocab_size"]) == ("bpe", sha, VOCAB)
        assert index["dtype"] == "<u2" and index["eos_id"] == tok.eos_id == 0
    # every byte string encodes and decodes back; the byte table counts the text's bytes exactly
    text = "Ünïcode <|endoftext|> tabs\t and\r\nnew lines"
    ids = tok.encode_ordinary(text)
    assert tok.decode(ids) == text and tok.eos_id not in ids
    assert int(tok.byte_lengths()[ids].sum()) == len(text.encode())
    assert tok.encode("a<|endoftext|>")[-1] == tok.eos_id  # prompts read it as the special token


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--vocab-size", "0"], "--vocab-size 0: a byte-level BPE needs at least 257"),
        (["--vocab-size", "-5"], "--vocab-size -5: a byte-level BPE needs at least 257"),
        (["--vocab-size", "256"], "--vocab-size 256"),
        (["--vocab-size", "100000"], "--vocab-size 100000: this corpus supports at most"),
        ([], "--tokenizer bpe: needs --vocab-size"),
    ],
)
def test_bad_vocab_size_is_one_line_exit_2_and_nothing_written(tmp_path, args, expected):
    result = _prepare(tmp_path / "out" / "data", *args, cwd=tmp_path)
    _one_line(result, expected)
    assert not (tmp_path / "out").exists()


def test_the_corpus_rule_names_the_largest_size_it_supports(tmp_path):
    docs = [text for _, text in embedded_documents()]
    with pytest.raises(UserError, match=r"supports at most (\d+) ids") as info:
        train_bpe(docs, 10**6)
    most = int(str(info.value).split("at most ")[1].split()[0])
    assert most > MIN_VOCAB
    train_bpe(docs, most)  # the size it names is one it gives


def test_vocab_size_with_o200k_and_no_input_are_refused(tmp_path):
    both = cli(
        ["--embedded", "--vocab-size", "512", "--out", str(tmp_path / "o")], tmp_path, "trmoe.data.prepare"
    )
    _one_line(both, "--vocab-size 512: o200k_base has its 200,019 ids")
    neither = cli(["--out", str(tmp_path / "o")], tmp_path, "trmoe.data.prepare")
    _one_line(neither, "or --embedded")
    assert not (tmp_path / "o").exists()


def test_a_run_on_bpe_shards_records_the_tokenizer_and_builds_over_its_vocabulary(bpe_run, dataset):
    from trmoe.load import load_model

    record = json.loads((bpe_run / "run_config.json").read_text())
    sha = hashlib.sha256((dataset / "tokenizer.json").read_bytes()).hexdigest()
    assert record["config"]["tokenizer"] == {
        "name": "bpe",
        "path": str(dataset / "tokenizer.json"),
        "sha256": sha,
    }
    assert record["config"]["model"]["vocab_size"] == VOCAB == record["model_spec"]["vocab_size"]
    assert (record["data"]["tokenizer"], record["data"]["tokenizer_sha256"]) == ("bpe", sha)
    loaded = load_model(bpe_run)
    assert loaded.model.embed.weight.shape[0] == VOCAB
    tables = [b for name, b in loaded.model.named_buffers() if name.endswith("route_table")]
    assert tables and all(t.shape[-1] == VOCAB for t in tables)  # the route tables cover its ids
    rows = (bpe_run / "metrics.csv").read_text().splitlines()
    header, last = rows[0].split(","), rows[-1].split(",")
    assert 0 < float(last[header.index("eval_bpb")]) < 20  # bits per byte: its bytes per id


def test_embedded_data_reads_with_a_bpe_file(dataset, tmp_path):
    result = cli(
        [
            *TRAIN,
            "trainer.steps=2",
            "data=embedded",
            "tokenizer=bpe",
            f"tokenizer.path={dataset}/tokenizer.json",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    (run,) = (tmp_path / "runs").iterdir()
    record = json.loads((run / "run_config.json").read_text())
    assert record["data"]["tokenizer"] == "bpe" and record["model_spec"]["vocab_size"] == VOCAB


def test_refusals_are_one_line_and_leave_no_run(dataset, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(train_bpe([t for _, t in embedded_documents()], VOCAB + 8))
    o200k_data = tmp_path / "o200k"
    (tmp_path / "c.txt").write_text("".join(f"document {i} says something else\n\n" for i in range(300)))
    args = [str(tmp_path / "c.txt"), "--out", str(o200k_data), "--workers", "0", "--eval-fraction", "0.3"]
    made = cli(args, tmp_path, "trmoe.data.prepare")
    assert made.returncode == 0, made.stderr
    cases = [
        (
            ["data=tokens", f"data.path={dataset}"],
            "made with tokenizer bpe (vocab 512), but this run reads text with o200k_base",
        ),  # fmt: skip
        (
            [
                "data=tokens",
                f"data.path={o200k_data}",
                "tokenizer=bpe",
                f"tokenizer.path={dataset}/tokenizer.json",
            ],
            "made with tokenizer o200k_base",
        ),  # fmt: skip
        (
            ["data=tokens", f"data.path={dataset}", "tokenizer=bpe", f"tokenizer.path={other}"],
            "point tokenizer.path at the tokenizer.json the shards were prepared with",
        ),  # fmt: skip
        (["data=embedded", "tokenizer=bpe"], "tokenizer.path=null: tokenizer=bpe needs its tokenizer.json"),
        (["data=tokens", f"data.path={o200k_data}", "tokenizer=bpe"], "(none beside data.path="),
        (["data=embedded", "tokenizer=bpe", f"tokenizer.path={tmp_path}/no.json"], "no such file"),
        (
            ["data=embedded", "tokenizer=bpe", f"tokenizer.path={other}", "model.vocab_size=1000"],
            "model.vocab_size=1000: tokenizer=bpe sets it to the tokenizer's 520 ids",
        ),  # fmt: skip
        (
            ["data=embedded", "tokenizer=bpe", f"tokenizer.path={other}", "tokenizer.sha256=abc"],
            "tokenizer.sha256=abc:",
        ),  # fmt: skip
        (
            ["data=fineweb", "data.path=x.parquet", "tokenizer=bpe", f"tokenizer.path={other}"],
            "tokenizes with o200k_base only",
        ),  # fmt: skip
    ]
    for overrides, expected in cases:
        result = cli([*TRAIN, *overrides, "run.name=refused"], cwd=tmp_path)
        _one_line(result, expected)
        assert not (tmp_path / "runs" / "refused").exists(), overrides


def test_a_record_from_before_the_tokenizer_group_composes_and_resumes_as_o200k(small_run):
    from trmoe.load import spec_from_config
    from trmoe.run.identity import compare, training_view

    record = json.loads((small_run / "run_config.json").read_text())
    old = {k: v for k, v in record["config"].items() if k != "tokenizer"}
    assert spec_from_config(old).vocab_size == record["config"]["model"]["vocab_size"]
    was = training_view(old, record.get("derived"), record.get("data"))
    now = training_view(record["config"], record.get("derived"), record.get("data"))
    assert compare(was, now).critical == {}  # the new keys at their defaults are no difference
    changed = {**record["config"], "tokenizer": {"name": "bpe", "path": "/x", "sha256": "a"}}
    assert "tokenizer.name" in compare(was, training_view(changed, None, record.get("data"))).critical


def test_sample_export_and_lm_eval_use_the_runs_tokenizer(bpe_run, dataset, tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from trmoe.load import load_model

    sampled = cli([str(bpe_run), "--prompt", "The", "--max-new-tokens", "4", "--greedy", "--out",
                   str(tmp_path / "s.jsonl")], tmp_path, "trmoe.sample")  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    loaded = load_model(bpe_run)
    tok = loaded.tokenizer()
    assert row["new_tokens"] >= 1 and tok.path == dataset / "tokenizer.json"

    exported = cli([str(bpe_run), "--out", str(tmp_path / "hf")], tmp_path, "trmoe.export")
    assert exported.returncode == 0, exported.stderr
    hf = tmp_path / "hf"
    assert (hf / "tokenizer.json").read_bytes() == (dataset / "tokenizer.json").read_bytes()
    hf_tok = AutoTokenizer.from_pretrained(hf)
    assert isinstance(hf_tok, PreTrainedTokenizerFast) and hf_tok.eos_token_id == tok.eos_id
    config = json.loads((hf / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["eos_token_id"] == tok.eos_id
    text = "The class statement defines a new class."
    ids = hf_tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == tok.encode_ordinary(text)
    model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True)
    with torch.no_grad():
        ours = loaded.model.logits(loaded.model(ids))
        assert torch.allclose(model(ids).logits[0], ours[0], atol=1e-4)

    evaluated = cli([f"run={bpe_run}", "tasks=[trmoe_tiny_mc]", f"include_path={TASKS}", "batch_size=4"],
                    tmp_path, "trmoe.eval")  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert "trmoe_tiny_mc: acc" in evaluated.stdout

    report = cli([str(bpe_run)], tmp_path, "trmoe.report")
    assert report.returncode == 0, report.stderr
    assert f"bpe, vocab {VOCAB}" in (bpe_run / "report.md").read_text()


def test_a_moved_or_changed_tokenizer_file_is_one_line(bpe_run, dataset, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(bpe_run, run)
    record = json.loads((run / "checkpoints").joinpath(sorted(p.name for p in (run / "checkpoints").iterdir()
                        if p.name.startswith("step_"))[-1], "meta.json").read_text())  # fmt: skip
    assert record["config"]["tokenizer"]["path"] == str(dataset / "tokenizer.json")
    moved = dataset / "tokenizer.json.away"
    (dataset / "tokenizer.json").rename(moved)
    try:
        result = cli([str(run), "--prompt", "x"], tmp_path, "trmoe.sample")
        _one_line(result, "is missing")
        out = cli([str(run), "--out", str(tmp_path / "hf")], tmp_path, "trmoe.export")
        _one_line(out, "is missing")
        assert not (tmp_path / "hf").exists()
    finally:
        moved.rename(dataset / "tokenizer.json")


def test_the_tokenizer_group_composes_o200k_by_default():
    cfg = compose_config()
    assert cfg.tokenizer.name.value == "o200k" and cfg.tokenizer.path is None
    assert cfg.model.vocab_size == 200_019
