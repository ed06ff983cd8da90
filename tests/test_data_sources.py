"""The data sources' registry and data=jsonl (trmoe/data/sources/jsonl.py): documents from JSON Lines files,
the same held-out rule as data=text; as a mixture source; bad inputs are one line, exit 2, nothing
written. And the registry's docs table of docs/data.md."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import cli, compose_config
from presets import DATA_FAST

from trmoe.config.resolve import to_config
from trmoe.data.build import build_data
from trmoe.errors import UserError

WORDS = ["cats", "dogs", "rain", "sun", "code", "tea", "maps", "ships", "bees", "salt"] * 3
DOCS = [
    (f"Document number {i} talks about {w} and the weather in town {i % 7}. " * 3).strip()
    for i, w in enumerate(WORDS)
]
RUN = [
    *DATA_FAST,
    "trainer.steps=3",
    "trainer.log_every=1",
    "trainer.micro_batch=2",
    "data.eval_fraction=0.3",
]


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def test_jsonl_trains_three_steps_and_resumes_from_moved_files(tmp_path):
    data = _jsonl(tmp_path / "docs.jsonl", DOCS)
    out = cli(["data=jsonl", f"data.path={data}", *RUN, "optimizer.decay_steps=5", "run.name=j"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "runs" / "j" / "metrics.csv").open()))
    assert rows[-1]["step"] == "3" and float(rows[-1]["train_loss"]) > 0
    record = json.loads((tmp_path / "runs" / "j" / "run_config.json").read_text())
    assert record["data"]["source"] == "jsonl" and record["data"]["files"]["paths"] == [str(data)]
    # the files' place may change between attempts, their content (the sha256s) may not
    moved = data.rename(tmp_path / "moved.jsonl")
    again = [f"data.path={moved}", *RUN, "trainer.steps=5", "optimizer.decay_steps=5", "run.name=j"]
    out = cli(["data=jsonl", *again], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed at step 3" in (tmp_path / "runs" / "j" / "train.log").read_text()
    _jsonl(moved, DOCS[:-1])  # other content at the same place: refused
    out = cli(["data=jsonl", *again, "trainer.steps=6"], tmp_path)
    assert out.returncode == 2 and "data_info" in out.stderr, out.stderr[-3000:]


def test_jsonl_holds_out_the_documents_data_text_holds_out(tmp_path):
    """Same documents -> same split: the content-hash rule of data=text, so the same token arrays."""
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(DOCS))
    folder = tmp_path / "parts"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", DOCS[:12])
    _jsonl(folder / "b.jsonl", DOCS[12:])
    common = [*RUN, "model=tiny", "data.split_seed=5"]
    a = build_data(to_config(compose_config(*common, "data=text", f"data.text_path={text}")), 200019)
    b = build_data(to_config(compose_config(*common, "data.source=jsonl", f"data.path={folder}")), 200019)
    assert a.info["train"] == b.info["train"] and a.info["eval"] == b.info["eval"]
    assert a.info["documents_sha256"] == b.info["documents_sha256"]
    assert [[t.tolist() for t in x] for x in a.eval_set] == [[t.tolist() for t in x] for x in b.eval_set]


def test_jsonl_as_a_mixture_source(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", DOCS, field="body")
    out = cli(
        [
            "data=mixture",
            f"+data.sources={{j: {{source: jsonl, path: '{data}', text_field: body, weight: 1}}, "
            "h: {source: embedded, weight: 1}}",
            *RUN,
            "run.name=m",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    header = (tmp_path / "runs" / "m" / "metrics.csv").read_text().splitlines()[0]
    assert "eval_loss/j" in header and "eval_loss/h" in header


def _bad(tmp_path: Path, args: list[str], needle: str) -> None:
    out = cli([*args, *RUN, "run.name=bad"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert not (tmp_path / "runs").exists()


def test_bad_jsonl_inputs_are_one_line_exit_2_nothing_written(tmp_path):
    _bad(tmp_path, ["data.source=jsonl", "data.path=nope.jsonl"], "data.path=nope.jsonl: no such file")
    _bad(tmp_path, ["data.source=jsonl"], "data.path=None: data=jsonl needs")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"text": DOCS[0]}) + "\n{not json\n")
    _bad(
        tmp_path,
        ["data.source=jsonl", f"data.path={broken}"],
        f"jsonl file {broken}: line 2 is not valid JSON",
    )
    other = _jsonl(tmp_path / "other.jsonl", DOCS, field="body")
    _bad(
        tmp_path,
        ["data.source=jsonl", f"data.path={other}"],
        f"{other}: line 1 has no field 'text' (data.text_field)",
    )
    _bad(tmp_path, ["data.jsonl_eval_path=x.jsonl"], "data.jsonl_eval_path=x.jsonl: only used by data=jsonl")
    _bad(
        tmp_path,
        ["data=mixture", "+data.sources={a: {source: jsonl, weight: 1}}"],
        "data.sources.a.path=None: data=jsonl needs",
    )


def test_the_sources_table_of_docs_data_md_is_the_registry():
    from trmoe.data.variant import source_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    assert source_table() in text


def test_a_jsonl_error_names_the_key(tmp_path):
    with pytest.raises(UserError, match="data.path"):
        to_config(compose_config("data.source=jsonl"))
