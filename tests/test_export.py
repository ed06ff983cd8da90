"""`python -m trmoe.export`: a Hugging Face directory that transformers loads offline, whose logits equal
trmoe's, whose generate() runs with its KV cache, whose tokenizer encodes as trmoe's does, and whose code
imports without trmoe; plain safetensors; bad input one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import cli, run_cli

pytest.importorskip("transformers")  # the `hf` extra (make test installs it)

from trmoe.data.tokenizer import EOS_ID, load_o200k  # noqa: E402
from trmoe.generate import Sampling, generate  # noqa: E402
from trmoe.load import load_model  # noqa: E402

MULTILINGUAL = (
    "Hello, world! Ünïcödé — 日本語のテキスト, 中文文本, русский текст, العربية, हिन्दी, 한국어, "
    "emoji 🤖🚀, numbers 1234567 and code: def f(x):\n\treturn x**2  \n\n<|endoftext|> after the end"
)


@pytest.fixture(scope="module")
def hf_model(exported):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True, dtype=torch.float32).eval()


def test_directory_holds_what_transformers_needs(exported):
    names = sorted(p.name for p in exported.iterdir())
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "configuration_trmoe.py",
        "modeling_trmoe.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert name in names
    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_trmoe.TRMoEForCausalLM"
    from safetensors import safe_open

    with safe_open(exported / "model.safetensors", "pt") as f:
        tables = [k for k in f.keys() if k.endswith("route_table")]
        assert len(tables) == 2 and f.get_tensor(tables[0]).dtype == torch.uint8
    assert not any(p.name.startswith(".") for p in exported.parent.iterdir())  # no temporary left


def test_hf_logits_equal_trmoe_logits(text_run, hf_model):
    trmoe = load_model(text_run).model
    ids = torch.tensor(
        [load_o200k().encode("The cat sat on the mat and looked at the red ball. Water boils")]
    )
    with torch.no_grad():
        ours = trmoe.logits(trmoe(ids))
        theirs = hf_model(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"exported (transformers) vs trmoe logits, fp32: max abs difference {diff:.2e}")
    assert theirs.shape == ours.shape and diff <= 1e-4


def test_generate_with_the_cache_matches_trmoe(text_run, exported, hf_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    assert tok.padding_side == "left"  # the tokenizer config's: batched generation pads on the left
    prompts = ["The cat sat on", "Water"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    out = hf_model.generate(**batch, max_new_tokens=6, do_sample=False, use_cache=True)
    trmoe = load_model(text_run).model
    expected = generate(
        trmoe, [tok(p)["input_ids"] for p in prompts], Sampling(6, greedy=True), eos_id=EOS_ID
    )
    width = batch["input_ids"].shape[1]
    for row, want in zip(out[:, width:].tolist(), expected, strict=True):
        assert row[: len(want)] == want
    # the cache gives the logits a full recompute gives
    ids = batch["input_ids"][1:]
    with torch.no_grad():
        step = hf_model(ids[:, :-2], use_cache=True)
        cached = hf_model(ids[:, -2:], cache=step.cache, use_cache=True).logits
        full = hf_model(ids, use_cache=False).logits[:, -2:]
    assert (cached - full).abs().max() < 1e-4


def test_conventions_a_user_of_transformers_expects(text_run, exported, hf_model, caplog):
    """No warning on a batched generate (max length from the model's context, left padding); no local
    path in config.json (the run's name and the weights' hash instead); files readable like any other."""
    import hashlib
    import os
    import warnings

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    batch = tok(["The cat sat on", "Water"], return_tensors="pt", padding=True)
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        hf_model.generate(**batch, max_new_tokens=3, do_sample=False)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert not said, "\n".join(said)
    assert "max_length" not in json.loads((exported / "generation_config.json").read_text())
    text = (exported / "config.json").read_text()
    assert str(text_run) not in text and str(text_run.parent) not in text and '"/' not in text
    source = json.loads(text)["trmoe"]
    assert source["run"] == text_run.name and source["step"] == 60
    weights = hashlib.sha256((exported / "model.safetensors").read_bytes()).hexdigest()
    assert source["weights_sha256"] == weights
    umask = os.umask(0)
    os.umask(umask)
    for path in exported.iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, (path.name, oct(path.stat().st_mode))
    assert exported.stat().st_mode & 0o777 == 0o777 & ~umask


def test_tokenizer_encodes_as_trmoe(exported):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    ours = load_o200k().encode(MULTILINGUAL, allowed_special="all")
    assert tok(MULTILINGUAL)["input_ids"] == ours
    assert tok.eos_token_id == EOS_ID and tok.convert_tokens_to_ids("<|endofprompt|>") == 200018
    assert tok.decode(ours, skip_special_tokens=False) == MULTILINGUAL


@pytest.mark.subprocess
def test_the_tokenizer_loads_with_no_question_and_no_remote_code(exported, tmp_path):
    """The tokenizer is the library's own class (tokenizer_config.json names it and maps no code), so
    PreTrainedTokenizerFast loads it with no prompt, and AutoTokenizer with trust_remote_code=True
    (transformers 5 reads the model's config first, and that config class is the export's code) returns the
    same class. In a fresh process with no terminal: transformers' [y/N] question would be printed there."""
    assert "auto_map" not in json.loads((exported / "tokenizer_config.json").read_text())
    script = f"""
from transformers import AutoTokenizer, PreTrainedTokenizerFast
plain = PreTrainedTokenizerFast.from_pretrained({str(exported)!r})
auto = AutoTokenizer.from_pretrained({str(exported)!r}, trust_remote_code=True)
assert type(plain) is type(auto) and type(auto).__module__.startswith("transformers."), type(auto)
assert plain("The cat")["input_ids"] == auto("The cat")["input_ids"]
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr


@pytest.mark.subprocess
def test_exported_code_imports_without_trmoe(exported, hf_model, tmp_path):
    ids = [[1, 2, 3, 4, 5]]
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits
    torch.save(expected, tmp_path / "expected.pt")
    script = f"""
import sys
sys.modules["trmoe"] = None  # any import of trmoe fails
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True, dtype=torch.float32)
got = m(torch.tensor({ids})).logits
assert torch.equal(got, torch.load({str(tmp_path / "expected.pt")!r})), "logits differ"
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_plain_safetensors_format(text_run, tmp_path):
    from safetensors.torch import load_file

    result = cli(
        [str(text_run), "--out", str(tmp_path / "st"), "--format", "safetensors"],
        cwd=tmp_path,
        module="trmoe.export",
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["config.json", "model.safetensors"]
    weights = load_file(tmp_path / "st" / "model.safetensors")
    state = load_model(text_run).model.state_dict()
    assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state)
    assert json.loads((tmp_path / "st" / "config.json").read_text())["step"] == 60


@pytest.mark.subprocess
def test_bad_input_is_one_line_and_writes_nothing(text_run, tmp_path, tmpfs, capsys):
    from trmoe.export.__main__ import main

    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)  # a read-only place to export to
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("keep")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        ([str(text_run), "--out", str(taken)], "not empty"),
        ([str(text_run), "--out", str(a_file)], "is a file"),
        ([str(text_run), "--out", str(tmpfs / "o")], f"--out {tmpfs / 'o'}: {tmpfs} is not writable"),
        ([str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "no such file"),
        ([str(text_run), "--out", str(tmp_path / "o"), "--step", "3"], "step=3"),
        ([str(text_run), "--out", str(tmp_path / "o"), "--format", "onnx"], "--format"),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        code = main(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    result = run_cli([str(text_run)], cwd=tmp_path, module="trmoe.export")  # the real command line
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--out" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "small", "taken"]
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
