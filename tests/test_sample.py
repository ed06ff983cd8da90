"""Generation: the KV cache reproduces the full forward, decoding is deterministic, a trained model prefers
its training text, checkpoints of both formats load through the one loader, and `python -m trmoe.sample`
answers bad input with one line and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cached_logits, cli, compose_config
from presets import FAST_CPU, TRAINING_SENTENCES

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.generate import Sampling, generate
from trmoe.load import load_model
from trmoe.model.transformer import TRMoETransformer


def _model(*overrides: str) -> TRMoETransformer:
    torch.manual_seed(0)
    model = TRMoETransformer(model_spec(to_config(compose_config("model.vocab_size=512", *overrides)))).eval()
    with torch.no_grad():  # non-trivial norms, gates and attention (init leaves them near uniform)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        ("attention=gqa", "routing=modulo_cyclic"),  # tokens grouped by route tuple
        ("attention=mha", "routing=multi_hash", "routing.top_k=2"),  # grouped by expert
        ("attention=mqa", "model.num_experts=1", "routing.top_k=1"),  # the dense control
        ("routing=frozen_router",),  # a router on the layer's input: per token, so a cache changes nothing
        ("routing=rerandomised_router",),  # its last step's draw
        ("routing=hybrid_first_k",),  # a table in layer 0, a learned router above
        ("routing=learned_v3",),  # sigmoid scores plus its (perturbed, non-zero) balancing bias
        ("routing=balanced_hash", "routing.combine=learned"),  # the table's routes, a learned combine gate
        ("routing=learned_v3", "routing.layers=[{first: 0, last: 0, strategy: dense}]"),  # a dense layer 0
    ],
)
def test_kv_cache_gives_the_full_forward_logits_at_every_position(overrides):
    model = _model(*overrides)
    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.logits(model(ids))
        worst = 0.0
        for chunks in ([1] * 40, [7, 1, 1, 13, 18], [40]):  # token by token, prefill + steps, one prefill
            diff = (cached_logits(model, ids, chunks) - full).abs().max().item()
            worst = max(worst, diff)
    print(f"KV cache vs full forward, fp32, {overrides}: max abs logit difference {worst:.2e}")
    assert worst < 1e-4


def test_left_padded_rows_decode_as_they_would_alone():
    model = _model()
    gen = torch.Generator().manual_seed(2)
    short, long = torch.randint(0, 512, (1, 9), generator=gen), torch.randint(0, 512, (1, 20), generator=gen)
    batch = torch.cat([torch.cat([torch.zeros(1, 11, dtype=torch.long), short], 1), long])
    with torch.no_grad():
        cache = model.new_cache(2, 24, torch.tensor([11, 0]))
        both = model.logits(model(batch, cache))
        alone_short = model.logits(model(short))
        alone_long = model.logits(model(long))
    assert (both[0, 11:] - alone_short[0]).abs().max() < 1e-4
    assert (both[1] - alone_long[0]).abs().max() < 1e-4
    # and batched generation continues each row as generating it alone does
    prompts = [short[0].tolist(), long[0].tolist()]
    s = Sampling(max_new_tokens=4, greedy=True)
    assert generate(model, prompts, s) == [generate(model, [p], s)[0] for p in prompts]


def test_decoding_is_deterministic_and_seeded():
    model = _model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    greedy = Sampling(max_new_tokens=6, greedy=True)
    assert generate(model, prompts, greedy) == generate(model, prompts, greedy)
    sampled = Sampling(max_new_tokens=6, temperature=1.5, top_k=50, top_p=0.9, seed=3)
    first = generate(model, prompts, sampled)
    assert first == generate(model, prompts, sampled)
    assert all(len(row) == 6 for row in first)
    others = [generate(model, prompts, Sampling(max_new_tokens=6, temperature=1.5, seed=s)) for s in range(4)]
    assert len({json.dumps(o) for o in others}) > 1  # the seed matters


def test_top_k_one_is_greedy():
    model = _model()
    prompts = [[9, 8, 7, 6]]
    assert generate(model, prompts, Sampling(max_new_tokens=5, top_k=1, seed=5)) == generate(
        model, prompts, Sampling(max_new_tokens=5, greedy=True)
    )


def _loglik(model, prefix: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([prefix + continuation])
    with torch.no_grad():
        logp = model.logits(model(ids)).float().log_softmax(-1)[0]
    n = len(prefix)
    return sum(logp[n - 1 + i, t].item() for i, t in enumerate(continuation))


def test_a_trained_model_prefers_its_training_text(text_run):
    from trmoe.data.tokenizer import load_o200k

    enc = load_o200k()
    loaded = load_model(text_run)
    assert loaded.step == 60 and loaded.text_vocab
    wins = 0
    for sentence in TRAINING_SENTENCES:
        ids = enc.encode(sentence)
        prefix, rest = ids[:4], ids[4:]
        shuffled = rest[::-1] if rest[::-1] != rest else rest[1:] + rest[:1]
        wins += _loglik(loaded.model, prefix, rest) > _loglik(loaded.model, prefix, shuffled)
    assert wins == len(TRAINING_SENTENCES)


def test_sample_cli_writes_jsonl(text_run, tmp_path):
    out = tmp_path / "samples.jsonl"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat sat\nWater boils\n")
    result = cli(
        [
            str(text_run),
            "--prompt-file",
            str(prompts),
            "--greedy",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        module="trmoe.sample",
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["The cat sat", "Water boils"]
    assert all(r["step"] == 60 and 0 < r["new_tokens"] <= 8 for r in rows)
    assert all(r["finish"] in ("eos", "length") for r in rows)


def test_stop_string_cuts_the_continuation(text_run, capsys):
    from trmoe.sample import run

    rows = run([str(text_run), "--prompt", "The cat", "--greedy", "--max-new-tokens", "12"])
    free = rows[0]["completion"]
    assert len(free) > 3
    stop = free[2:4]
    capsys.readouterr()
    rows = run([str(text_run), "--prompt", "The cat", "--greedy", "--max-new-tokens", "12", "--stop", stop])
    assert rows[0]["finish"] == "stop" and rows[0]["completion"] == free[: free.find(stop)]


def test_torch_and_dcp_checkpoints_load_to_the_same_model(tmp_path, one_thread):
    from trmoe.train.loop import train

    base = [
        *FAST_CPU,
        "trainer.steps=3",
        "trainer.micro_batch=2",
        "trainer.eval_every=0",
        "checkpoint.every_steps=2",
    ]
    train(compose_config(*base), tmp_path / "torch")
    train(compose_config(*base, "checkpoint.format=dcp"), tmp_path / "dcp")
    for step in (2, 3):
        a = load_model(tmp_path / "torch", step).model.state_dict()
        b = load_model(tmp_path / "dcp" / "checkpoints", step).model.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_model(tmp_path / "dcp").step == 3
    one = load_model(tmp_path / "torch" / "checkpoints" / "step_00000002")
    assert one.step == 2 and one.run_dir == tmp_path / "torch"


def _one_line(result, *expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def test_bad_input_is_one_line_and_exit_2(text_run, tmp_path, capsys):
    from trmoe.sample import main

    cases = [
        ([str(tmp_path / "nope"), "--prompt", "x"], ["no such file"]),
        ([str(text_run), "--step", "7", "--prompt", "x"], ["step=7", "allowed: [60]"]),
        ([str(text_run), "--prompt", ""], ["prompt 1 is empty"]),
        ([str(text_run), "--prompt", "x", "--max-new-tokens", "-1"], ["max_new_tokens=-1"]),
        ([str(text_run), "--prompt", "x", "--top-p", "0"], ["top_p=0.0"]),
        ([str(text_run)], ["no prompt"]),
        ([str(text_run), "--prompt", "x", "--max-new-tokens", "5000"], ["max_seq_len"]),
        ([str(tmp_path), "--prompt", "x"], ["holds no checkpoint"]),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        code = main(argv)
        err = capsys.readouterr().err

        class Result:
            returncode, stderr = code, err

        _one_line(Result, *expected)
    existing = tmp_path / "taken.jsonl"
    existing.write_text("keep\n")
    assert main([str(text_run), "--prompt", "x", "--out", str(existing)]) == 2
    assert existing.read_text() == "keep\n"
    # and through the real command line
    _one_line(cli(["--step", "x"], cwd=tmp_path, module="trmoe.sample"), "python -m trmoe.sample")


def test_random_id_runs_are_refused_for_text(tmp_path, one_thread, capsys):
    from trmoe.sample import main
    from trmoe.train.loop import train

    train(
        compose_config(*FAST_CPU, "trainer.steps=1", "trainer.micro_batch=1", "trainer.eval_every=0"),
        tmp_path / "r",
    )
    capsys.readouterr()
    assert main([str(tmp_path / "r"), "--prompt", "x"]) == 2
    assert "not o200k_base text" in capsys.readouterr().err


def test_capacity_is_checked_before_decoding():
    from trmoe.errors import UserError

    model = _model()
    with pytest.raises(UserError, match="max_seq_len"):
        generate(model, [[1] * 10], Sampling(max_new_tokens=model.spec.max_seq_len))
    # a prompt longer than the context is blamed, not max_new_tokens ("allowed: at most 0")
    limit = model.spec.max_seq_len
    with pytest.raises(
        UserError, match=f"^prompt: {limit + 5} tokens, longer than the model's max_seq_len={limit}"
    ):
        generate(model, [[1] * (limit + 5)], Sampling(max_new_tokens=0))
