"""model.parametrization=mup (docs/mup.md): sp bit-identical to before, mup at its base shape is sp, the
per-group lr/weight-decay factors of every optimizer, parameter counts and matching unchanged, the
coordinate check (flat under mup, growing under sp, failing with a multiplier removed), the checkpoint
records the parametrization, the HF export's logits equal trmoe's, sample and eval run on a mup model, bad
input exit 2."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from helpers import cli, compose_config, train_in_process
from presets import FAST_CPU, TEXT_RUN, TRAINING_SENTENCES

from trmoe.bench.coordcheck import coord_check
from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.model.transformer import TRMoETransformer, parameter_counts
from trmoe.optim.build import build_optimizer

MUP = ["model.parametrization=mup", "model.mup_base_width=32"]  # model=tiny: H=64, so m_d = 2

# Recorded at commit 7b6263d, before model.parametrization existed (hardware.threads=1, this CPU's torch):
# sha256 over the sorted state dict of a fresh model after torch.manual_seed(0), and RESUME_BASE's final
# held-out loss after 6 steps.
INIT_SHA = {
    (): "f027897003f8837b49fb44258780457904672cd8ea66d0cdc0c335970f6c4508",
    (
        "model.vocab_size=256",
        "model.gates=true",
    ): "07d50260eace822e67773f2edc1cb9f9202258d37a7374c446dfee2bb86efcdb",
}
SIX_STEP_LOSS = 6.257262468338013


def _spec(*overrides: str):
    return model_spec(to_config(compose_config("data=random", "model.vocab_size=512", *overrides)))


def _init_sha(spec) -> str:
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    digest = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("extra", list(INIT_SHA), ids=["default", "vocab256-gates"])
def test_sp_init_is_bit_identical_to_before(extra):
    assert _init_sha(_spec(*extra)) == INIT_SHA[extra]
    assert _init_sha(_spec(*extra, "model.parametrization=sp")) == INIT_SHA[extra]


def test_sp_training_is_bit_identical_to_before(tmp_path):
    assert train_in_process(tmp_path / "r", "trainer.steps=6", "model.parametrization=sp") == SIX_STEP_LOSS


def test_mup_at_its_base_shape_is_sp():
    """Every multiplier is 1 when the model is its own base: the same weights and the same forward."""
    sp, mup = _spec(), _spec("model.parametrization=mup", "model.mup_base_width=64")
    assert _init_sha(mup) == _init_sha(sp)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    a = TRMoETransformer(sp)
    torch.manual_seed(0)
    b = TRMoETransformer(mup)
    with torch.no_grad():
        assert torch.equal(a.logits(a(ids)), b.logits(b(ids)))


def test_mup_init_and_forward_multipliers():
    spec = _spec(*MUP)
    assert (spec.mup_width_mult, spec.mup_shared_mult, spec.mup_routed_mult) == (2.0, 2.0, 2.0)
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    assert model.output_mult == 0.5
    assert model.blocks[0].attn.scale == pytest.approx(math.sqrt(32 // 4) / 16)  # sqrt(d_0) / d
    residual = 0.02 / math.sqrt(2 * spec.num_layers)
    stds = {
        "embed.weight": 0.02,
        "blocks.0.attn.qkv.weight": 0.02 / math.sqrt(2),
        "blocks.0.attn.out.weight": residual / math.sqrt(2),
        "blocks.0.ffn.shared.w_in": 0.02 / math.sqrt(2),
        "blocks.0.ffn.shared.w_out": residual / math.sqrt(2),
    }
    params = dict(model.named_parameters())
    for name, std in stds.items():
        assert params[name].std().item() == pytest.approx(std, rel=0.1), name
    separate = _spec(*MUP, "model.mup_base_shared_width=48", "model.mup_base_routed_width=16")
    assert (separate.mup_shared_mult, separate.mup_routed_mult) == (4.0, 4.0)  # 192 / 48, 64 / 16


@pytest.mark.parametrize("optimizer", ["adamw", "muon_tr", "stosignsgd"])
def test_every_optimizer_scales_lr_down_and_weight_decay_up_by_the_fan_in_multiplier(optimizer):
    overrides = [*MUP, f"optimizer={optimizer}", "optimizer.lr=1e-3", "optimizer.weight_decay=0.1"]
    cfg = to_config(compose_config("data=random", "model.vocab_size=512", *overrides))
    model = TRMoETransformer(model_spec(cfg))
    opt = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    where = {id(p): g for g in opt.param_groups for p in g["params"]}
    params = dict(model.named_parameters())

    def group(name):
        return where[id(params[name])]

    muon = cfg.optimizer.muon_lr_scale if optimizer == "muon_tr" else 1.0
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.ffn.shared.w_out"):
        assert group(name)["lr"] == pytest.approx(1e-3 / 2)
        assert group(name)["weight_decay"] == pytest.approx(0.2)
    assert group("blocks.0.ffn.routed.w_out")["lr"] == pytest.approx(1e-3 / 2 * muon)
    assert group("embed.weight")["lr"] == pytest.approx(1e-3)
    assert "_mup2" in group("blocks.0.ffn.routed.w_in")["name"]


def test_parameter_counts_and_matching_are_unchanged():
    assert parameter_counts(_spec(*MUP)) == parameter_counts(_spec())
    match = ["model.match_params=13500000"]
    sp = to_config(compose_config("data=random", *match))
    mup = to_config(compose_config("data=random", *match, *MUP))
    assert mup.model.shared_width == sp.model.shared_width


# The coordinate check (trmoe.bench.coordcheck) by its own criterion (coordcheck.BAND, BANDS): |slope| <= 0.25
# for the Theta(1) activations (muP: 0 up to finite-width noise, measured <= 0.15; SP grows with slope ~1/2
# from its fixed-std init, ~1 from Adam's updates), and attention logits that do not grow with width.
WIDTHS = (64, 128, 256, 512)


def test_coordinate_check_passes_under_mup_and_grows_under_sp():
    mup = coord_check("mup", WIDTHS, steps=4)
    print(f"mup slopes {mup.slopes}")
    assert mup.failures() == {}
    # the attention logits are recorded, per layer, and ~1 in RMS at the base width (QK-norm)
    assert {"attn_logits.0", "attn_logits.1"} <= mup.slopes.keys()
    assert 0.5 < mup.rms["attn_logits.0"][0][0] < 2
    sp = coord_check("sp", WIDTHS, steps=4)
    print(f"sp slopes {sp.slopes}")
    assert max(sp.slopes.values()) > 0.5 and sp.failures()


@pytest.mark.parametrize(
    ("drop", "caught"),
    [("output", "logits"), ("init", "shared"), ("lr", "shared"), ("attention", "attn_logits")],
)
def test_coordinate_check_fails_with_a_multiplier_removed_by_hand(drop, caught):
    """Each of the four muP mistakes (the readout multiplier, the init stds, the per-width LR, the attention
    scale back to 1/sqrt(d) at every width) fails the check itself, on the coordinate it breaks."""
    check = coord_check("mup", WIDTHS, steps=4, drop=drop)
    print(f"mup without its {drop} multiplier: {check.failures()}")
    assert any(name.split(".")[0] == caught for name in check.failures()), check.slopes
    if (
        drop == "attention"
    ):  # ~1 in RMS at every width at init: the broken scale cannot be seen before updates
        start = check.rms["attn_logits.0"][0]
        assert max(start) / min(start) < 1.25


def test_checkpoint_records_the_parametrization(tmp_path):
    run = tmp_path / "r"
    train_in_process(run, "trainer.steps=2", "trainer.eval_every=0", "checkpoint.every_steps=2", *MUP)
    config = json.loads((run / "run_config.json").read_text())
    assert config["config"]["model"]["parametrization"] == "mup"
    from trmoe.load import load_model

    loaded = load_model(run)
    assert loaded.spec.parametrization == "mup" and loaded.model.output_mult == 0.5


@pytest.fixture(scope="module")
def mup_text_run(tmp_path_factory):
    from trmoe.train.loop import train

    root = tmp_path_factory.mktemp("mup_text")
    corpus = root / "corpus.txt"
    docs = [" ".join(TRAINING_SENTENCES)] * 20 + ["Held out text about something else entirely."] * 3
    corpus.write_text("\n\n".join(f"{d} ({i})" for i, d in enumerate(docs)) + "\n")  # as conftest's text_run
    threads = torch.get_num_threads()
    try:
        train(compose_config(*TEXT_RUN, f"data.text_path={corpus}", "trainer.steps=6", *MUP), root / "run")
    finally:
        torch.set_num_threads(threads)
    return root / "run"


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_qk_norm"])
def test_hf_export_of_a_mup_model_gives_trmoe_logits(tmp_path, qk_norm):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from trmoe.export import export
    from trmoe.load import load_model

    run = tmp_path / "r"
    overrides = [*FAST_CPU, "trainer.steps=3", "trainer.eval_every=0", *MUP, f"attention.qk_norm={qk_norm}"]
    train_in_process(run, *overrides)
    loaded = load_model(run)
    out = export(loaded, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = loaded.model.logits(loaded.model(ids))
        theirs = hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"mup export (qk_norm={qk_norm}) vs trmoe logits, fp32: max abs difference {diff:.2e}")
    assert theirs.shape == ours.shape and diff <= 1e-5


def test_sample_and_eval_run_on_a_mup_model(mup_text_run, tmp_path):
    sample = cli(
        [str(mup_text_run), "--prompt", "The cat", "--greedy", "--max-new-tokens", "4"],
        tmp_path,
        "trmoe.sample",
    )
    assert sample.returncode == 0, sample.stderr
    pytest.importorskip("lm_eval")
    from pathlib import Path

    tasks = Path(__file__).parent / "lm_eval_tasks"
    args = [f"run={mup_text_run}", "tasks=[trmoe_tiny_mc]", f"include_path={tasks}", "batch_size=4"]
    result = cli(args, cwd=tmp_path, module="trmoe.eval")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trmoe_tiny_mc" in json.loads((mup_text_run / "eval" / "6.json").read_text())["results"]


BAD = [
    (["model.parametrization=mup", "model.mup_base_width=128"], "model.mup_base_width=128"),
    (["model.parametrization=mup"], "model.mup_base_width=None"),
    (["model.parametrization=mup", "model.mup_base_width=30"], "model.num_heads"),
    (
        ["model.parametrization=mup", "model.mup_base_width=32", "model.mup_base_shared_width=1000"],
        "shared_width",
    ),
    (["model.mup_base_width=32"], "only with model.parametrization=mup"),
    (  # a base expert width of 3 / 4 = 0.75: a base whose expert width is no whole number
        [*MUP, "model.num_experts=4", "model.mup_base_routed_width=3"],
        "model.mup_base_routed_width=3: must be a multiple of model.num_experts=4",
    ),
    (["model.parametrization=mupp"], "model.parametrization"),
    ([*MUP, "routing=learned"], "routing.strategy=learned"),
    ([*MUP, "model.init=legacy_kaiming"], "model.init=legacy_kaiming"),
]


@pytest.mark.parametrize("overrides,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_one_line_exit_2(tmp_path, overrides, needle):
    result = cli([*FAST_CPU, "trainer.steps=1", *overrides], tmp_path)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not any(tmp_path.iterdir())


def test_bench_coordcheck_bad_input_is_one_line_exit_2(tmp_path):
    for args in (
        ["coordcheck", "--widths", "64"],
        ["coordcheck", "--drop", "gates"],
        ["lrtransfer", "--lrs", "0"],
    ):
        result = cli(args, tmp_path, "trmoe.bench")
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
