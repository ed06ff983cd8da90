"""Composition of every group option, schema enforcement, and the one-line exit-2 config errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import CONF_DIR, cli, compose_config, run_cli
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError
from presets import FAST_CPU

from trmoe.config.resolve import to_config
from trmoe.config.schema import GROUPS, Config, group_options
from trmoe.config.spec import model_spec
from trmoe.data.variant import SOURCES
from trmoe.errors import UserError

GROUP_OPTIONS = sorted((group, option) for group in GROUPS for option in group_options(group))


def test_every_group_has_options_and_a_default():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert groups == set(GROUPS)
    cfg = to_config(compose_config())
    assert isinstance(cfg, Config)
    assert (cfg.model.name, cfg.attention.kind.value, cfg.routing.strategy.value) == (
        "tiny",
        "gqa",
        "modulo_cyclic",
    )
    assert (cfg.optimizer.name, cfg.data.source.value, cfg.hardware.device.value) == (
        "adamw",
        "embedded",
        "auto",
    )
    assert cfg.loss.backend.value == "chunked"


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS)
def test_every_option_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if (group, option) == ("routing", "frequency_balanced_secondary"):  # it reads real token counts
        import numpy as np

        np.save(tmp_path / "token_counts.npy", np.arange(200_019, dtype=np.int64) % 5)
        overrides.append(f"routing.frequencies={tmp_path}")
    if (group, option) in (("routing", "clustered_hash"), ("routing", "dispersed_hash")):  # a real embedding
        import numpy as np

        np.save(
            tmp_path / "embedding.npy",
            np.random.default_rng(0).standard_normal((200_019, 4), dtype=np.float32),
        )
        overrides.append(f"routing.embedding={tmp_path / 'embedding.npy'}")
    if (group, option) == ("routing", "distilled"):  # it names its parent run (checked where a run starts)
        overrides.append(f"routing.distill_from={tmp_path}")
    if (group, option) == ("routing", "dense"):  # a per-layer strategy: every layer dense is refused
        overrides.append("routing.layers=[{first: 1, last: 1, strategy: balanced_hash}]")
    if group == "data" and option in SOURCES:  # a source's own example of a complete selection
        overrides += SOURCES.get(option).example
    if (group, option) == ("tokenizer", "bpe"):  # a real tokenizer.json; model.vocab_size follows it
        from trmoe.data.bpe import train_bpe

        (tmp_path / "tokenizer.json").write_text(train_bpe(["a small corpus, a small corpus"] * 4, 260))
        overrides.append(f"tokenizer.path={tmp_path / 'tokenizer.json'}")
    cfg = to_config(compose_config(*overrides))
    if group == "tokenizer":
        assert cfg.model.vocab_size == (260 if option == "bpe" else 200_019)
    spec = model_spec(cfg)
    assert spec.num_heads % spec.num_kv_heads == 0
    if group == "model":
        assert cfg.model.name == option
    if group == "attention":
        assert cfg.attention.kind.value == option
        expected = {"mha": cfg.model.num_heads, "mqa": 1, "gqa": cfg.model.num_kv_heads}[option]
        assert spec.num_kv_heads == expected
    if group == "routing":  # a strategy's preset, or a per-layer mix (routing.layers) of them
        assert cfg.routing.strategy.value == option or set(spec.strategies) >= {"learned", "balanced_hash"}


def test_schema_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ConfigCompositionException, match="hiden_size"):
        compose_config("model.hiden_size=64")
    with pytest.raises(ConfigCompositionException, match="mla"):
        compose_config("attention.kind=mla")
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError), match="top_k"):
        compose_config("routing.top_k=two")


def test_depth_interpolated_scales_and_forced_primary_weight():
    cfg = to_config(compose_config("model=100m", "model.routed_scale=1.0", "model.routed_scale_last=2.0"))
    spec = model_spec(cfg)
    assert spec.routed_scales[0] == 1.0 and spec.routed_scales[-1] == 2.0
    assert spec.routed_scales[5] == pytest.approx(1.0 + 5 / 9)
    assert spec.shared_scales == (1.0,) * 10
    assert (
        model_spec(to_config(compose_config("routing.top_k=1", "routing.primary_weight=0.3"))).primary_weight
        == 1.0
    )


CROSS_FIELD_ERRORS = [
    (["model.num_kv_heads=3"], "model.num_kv_heads=3"),
    (["model.num_heads=3"], "model.num_heads=3"),
    (["routing.top_k=5"], "routing.top_k=5"),
    (["model.routed_width=66"], "model.routed_width=66"),
    (["model.shared_width=0", "model.routed_width=0"], "model.routed_width=0"),
    (["trainer.seq_len=4096"], "trainer.seq_len=4096"),
    (["trainer.stop_within=0"], "trainer.stop_within=0"),
    (["trainer.max_hours=nan"], "trainer.max_hours=nan"),
    (["routing.primary_weight=1.5"], "routing.primary_weight=1.5"),
    (["data=text"], "data.text_path"),
    (["data.eval_fraction=0"], "data.eval_fraction=0"),
    (["loss.label_smoothing=1.0"], "loss.label_smoothing=1.0"),
    (["trainer.steps=0"], "trainer.steps=0"),
    # NaN passes every `x <= 0` test and inf trains to NaN: every float must be finite
    (["optimizer.lr=nan"], "optimizer.lr=nan: must be a finite number"),
    (["model.init_std=inf"], "model.init_std=inf"),
    (["guard.spike_factor=nan"], "guard.spike_factor=nan"),
    (["trainer.seed=-1"], "trainer.seed=-1"),
    (["attention.rope_theta=0"], "attention.rope_theta=0.0"),
    # a data path the chosen source never reads (the run would silently train on the default corpus)
    (["data.text_path=corpus.txt"], "data.text_path=corpus.txt: only used by data=text"),
    (["data.path=shards"], "data.path=shards: only used by data=tokens, data=fineweb"),
    # `+key=value` adds a key even to a structured config; converting it would silently drop it
    (["+trainer.stepz=3"], "trainer.stepz: trainer has no such key; did you mean steps?"),
    (["+foo=bar"], "foo: the config has no such key"),
    (["run.name=../escape"], "run.name='../escape': must name a directory inside runs/"),
    # a gate schedule where no gates exist (one branch): it would be silently ignored
    (["model.routed_width=0", "model.shared_gate_final=0.5"], "shared_gate_final=0.5: there are no gates"),
    (["run.name=/tmp/x"], "run.name='/tmp/x'"),
    # expert ids live in an int16 table: 0..32767
    (["model.num_experts=32769", "model.routed_width=32769"], "num_experts=32769: must be at most 32768"),
    (["routing.hash_count=9"], "routing.hash_count=9: must be between 1 and 8"),
]


def test_the_largest_expert_count_the_route_table_holds_is_accepted():
    cfg = to_config(compose_config("model.num_experts=32768", "model.routed_width=32768"))
    assert cfg.model.num_experts == 32768


@pytest.mark.parametrize(("overrides", "key"), CROSS_FIELD_ERRORS)
def test_cross_field_rules_name_the_key(overrides, key):
    with pytest.raises(UserError) as err:
        to_config(compose_config(*overrides))
    message = str(err.value)
    assert key in message and "\n" not in message


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["model.num_kv_heads=3"], "model.num_kv_heads=3"),
        (["routing.top_k=5"], "routing.top_k=5"),
        (["trainer.seq_len=4096"], "trainer.seq_len=4096"),
        (["data=text", "data.text_path=does/not/exist.txt"], "does/not/exist.txt"),
        (["hardware=cuda"], "hardware=cuda"),
        (["model.vocab_size=1000"], "model.vocab_size=1000"),
        (["routing=hybrid_first_k", "routing.layers.0.last=2"], "routing.layers[0]={first: 0, last: 2}"),
        (
            ["routing.layers=[{first: 0, last: 1, strategy: random},{first: 1, last: 1, strategy: random}]"],
            "routing.layers[1]={first: 1, last: 1}: overlaps routing.layers[0] at layer 1",
        ),
    ],
)
def test_cli_config_errors_exit_2_with_one_line_and_write_nothing(tmp_path: Path, args, needle):
    result = cli([*args, "trainer.steps=1"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    leftovers = [p for p in tmp_path.rglob("*")]
    assert leftovers == [], f"a failed start left files behind: {leftovers}"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["model.hiden_size=8"],
            "model.hiden_size: model has no such key; did you mean hidden_size? allowed:",
        ),
        (["routing=nope"], "Could not find 'routing/nope'; allowed: affine_hash, balanced_hash,"),
        (["attention.kind=mla"], "mla"),
        (["trainer.steps=abc"], "trainer.steps=abc"),
        # grids are not optional: a misspelt one must not silently run the default single job
        (["experiment=routing_ablation_smok"], "allowed: attention_matched, attention_matched_smoke,"),
        # arm is a group of grids: the allowed list names the grids, or the arms of the grid named
        (["arm=topk/nope"], "Could not find 'arm/topk/nope'; allowed: topk/dense, topk/k1, topk/k2_p050,"),
        (
            ["arm=nope"],
            "allowed: attention_matched/..., controls_2026/..., first_k/..., hash_vs_learned/..., "
            "roller_hash_table/..., router_persistence/..., routing_ablation/..., topk/...",
        ),
        (["experiment=topk_smoke", "arm=topk"], "Could not find 'arm/topk'; allowed: topk/dense, topk/k1,"),
        (["trainer.steps=[1"], "trainer.steps=[1: no viable alternative at input '[1'"),
        # a group takes one option: Hydra raised a ValueError for a number, and merged a list silently
        (["=5"], "=5: names no key; allowed: <key>=<value>, <group>=<option>"),
        (["model=[tiny,50m]"], "model=[tiny,50m]: the model group takes one option; allowed: 100m, 1b,"),
        # every job of a sweep composes before Hydra writes the sweep directory
        (["--multirun", "routing=modulo_cyclic,balanced_hashh"], "[sweep job 1: routing=balanced_hashh]"),
        (["experiment=topk_smoke", "trainer.steps=1,x"], "trainer.steps=x"),
        # Hydra's words point elsewhere ("Ambiguous value", "Multiple values", "Error parsing override"):
        # what the user meant instead
        (
            ["routing=modulo_cyclic,balanced_hash"],
            "routing=modulo_cyclic,balanced_hash: a comma-separated value is a sweep; add --multirun to "
            "sweep it",
        ),
        (["trainer.seed=1,2"], "add --multirun to sweep it (or trainer.seed=[1,2] for one list value)"),
        (["+experiment=topk_smoke"], "+experiment=topk_smoke: experiment is a group the config already has"),
        (["+experiment=topk_smoke"], "drop the +: experiment=topk_smoke"),
        (["trainer.steps", "10"], "trainer.steps: an override needs its '=' (no spaces around it); write "),
        (["trainer.steps", "10"], "write trainer.steps=10"),
        (["--multirun", "trainer.steps"], "write trainer.steps=<value>"),
    ],
)
def test_cli_composition_errors_exit_2_with_one_line(tmp_path: Path, args, needle):
    result = cli(args, cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("trmoe: config error: ") and needle in lines[0], lines
    assert "Traceback" not in result.stderr
    assert list(tmp_path.rglob("*")) == []


def _unavailable_device() -> str:
    """A hardware preset this machine cannot run: cuda without a GPU, else the other GPU kind's name."""
    import torch

    if not torch.cuda.is_available():
        return "cuda"
    return "cuda" if torch.version.hip is not None else "rocm"


@pytest.mark.parametrize(
    ("args", "jobs"),
    [
        # README's sweep, and a grid (which is a sweep by itself): every job would fail on the same line
        (["--multirun", "routing=modulo_cyclic,balanced_hash,multi_hash", "attention=gqa,mha"], "0-5 of 6"),
        (["experiment=routing_ablation_smoke"], "0-10 of 11"),
    ],
)
def test_a_sweep_no_job_of_which_can_run_is_refused_whole(tmp_path: Path, args, jobs):
    """A setting no job can run with (the device, which a job checked only once it started) is refused
    once, before Hydra writes a folder, as a single run refuses it, instead of a failed folder per job."""
    device = _unavailable_device()
    result = cli([*args, f"hardware={device}"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"trmoe: config error: hardware={device}: no {device.upper()} device")
    assert lines[0].endswith(f"[sweep jobs {jobs}; nothing was launched]")
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize("name", ["a/../../b", "../x", "../../../escape", ".", "./.", "a/.", "x/"])
def test_cli_a_run_name_outside_runs_creates_no_directory(tmp_path: Path, name: str):
    """Hydra makes hydra.run.dir before the job validates run.name: a '..' must be refused before that,
    or it leaves directories behind, even above the launch directory; a '.' would make runs/ itself (or
    a parent) the run directory, next to every other run."""
    launch = tmp_path / "up" / "launch"
    launch.mkdir(parents=True)
    result = cli([f"run.name={name}", "trainer.steps=1"], cwd=launch)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        f"trmoe: config error: run.name={name!r}: must name a directory inside runs/ "
        "(a/b nests; no '.' or '..' parts, no trailing '/', not absolute)"
    )
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["up", "up/launch"]


def test_cli_a_run_name_longer_than_a_directory_name_is_one_line(tmp_path: Path):
    result = cli([f"run.name=ok/{'n' * 300}", "trainer.steps=1"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().startswith("trmoe: config error: run.name: the part 'nnnn")
    assert "is 300 bytes long; allowed: at most 255 bytes per directory name" in result.stderr
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize(
    ("flag", "needle"), [("--hlep", "unrecognized arguments: --hlep"), ("--cfg=jobb", "'jobb'")]
)
def test_cli_hydra_flag_errors_are_one_line(tmp_path: Path, flag: str, needle: str):
    result = cli([flag], cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trmoe: train: ") and needle in lines[0], result.stderr
    assert list(tmp_path.rglob("*")) == []


def test_cli_sweeps_the_pre_check_cannot_expand_are_left_to_hydra(tmp_path: Path):
    """The sweep pre-check composes the packaged tree; a glob() sweep and a grid from --config-dir go to
    Hydra as before (they ran a job each, no refusal)."""
    extra = tmp_path / "extra" / "experiment"
    extra.mkdir(parents=True)
    (extra / "mine.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      trainer.seed: 7\n"
    )
    tiny = [*FAST_CPU, "trainer.steps=1", "trainer.micro_batch=2", "hydra.sweep.dir=sweep"]
    for args in (["-m", "model=glob(tin*)"], ["--config-dir", str(tmp_path / "extra"), "experiment=mine"]):
        result = cli([*args, *tiny], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert (tmp_path / "sweep" / "0" / "status.json").is_file()
        shutil.rmtree(tmp_path / "sweep")


def test_cli_a_file_in_the_way_of_the_run_directory(tmp_path: Path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mine").write_text("keep\n")
    result = cli(["run.name=mine", "trainer.steps=1"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "trmoe: cannot create the run directory runs/mine: a file is in the way"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["mine", "runs"]
    assert (tmp_path / "runs" / "mine").read_text() == "keep\n"


def test_cli_cfg_job_and_help(tmp_path: Path):
    result = cli(["--cfg", "job", "model=100m", "attention=mha"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hidden_size: 384" in result.stdout and "kind: mha" in result.stdout
    result = cli(["--help"], cwd=tmp_path)
    assert result.returncode == 0
    for group in GROUPS:
        assert f"{group}:" in result.stdout
    assert list(tmp_path.rglob("*")) == []
    import torch

    import trmoe

    result = cli(["--version"], cwd=tmp_path)  # trmoe's version and torch's, not Hydra's alone
    assert result.returncode == 0 and result.stdout.startswith(f"trmoe {trmoe.__version__} ")
    assert f"torch {torch.__version__}" in result.stdout


def test_configuration_reference_is_generated_from_the_schema():
    from trmoe.tools.configdoc import render

    doc = (CONF_DIR.parent / "docs" / "configuration.md").read_text()
    assert doc == render(), "docs/configuration.md is stale: run python -m trmoe.tools.configdoc"
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    assert rows and all(not line.endswith("|  |") for line in rows), "every option needs a meaning"


def test_an_experiment_file_of_ones_own_composes_on_top_of_trmoes_config(tmp_path: Path):
    """README, "Your own experiment file": a YAML whose defaults start with trmoe's config."""
    (tmp_path / "myconf").mkdir()
    (tmp_path / "myconf" / "pilot.yaml").write_text(
        "defaults:\n  - config\n  - override model: 100m\n  - override attention: mha\n  - _self_\n\n"
        "trainer:\n  steps: 2000\nrun:\n  name: pilot-mha\n"
    )
    args = ["--config-dir", "myconf", "--config-name", "pilot", "--cfg", "job", "trainer.seed=7"]
    result = cli(args, tmp_path)
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    chosen = (job["model"]["name"], job["attention"]["kind"], job["run"]["name"])
    assert chosen == ("100m", "mha", "pilot-mha")
    assert job["trainer"]["steps"] == 2000 and job["trainer"]["seed"] == 7  # the command line still applies
    assert not (tmp_path / "runs").exists()


@pytest.mark.subprocess
def test_help_names_the_app_trmoe_and_offers_no_schema_as_an_option(tmp_path):
    out = run_cli(["--help"], tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("trmoe is powered by Hydra")
    groups = out.stdout.split("== Config ==")[0]
    assert "model: " in groups and "base_" not in groups
    # Hydra's bash completion of `model=` (what `eval "$(trmoe-train -sc install=bash)"` asks): the profiles
    completion = subprocess.run(
        [sys.executable, "-m", "trmoe.train", "-sc", "query=bash"],
        env={**os.environ, "COMP_LINE": "trmoe-train model="},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert completion.returncode == 0, completion.stderr
    assert "model=tiny" in completion.stdout and "base_model" not in completion.stdout


def test_cfg_hydra_resolves(tmp_path):
    out = cli(["--cfg", "hydra", "--resolve"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "name: trmoe" in out.stdout and "dir: runs/tiny-gqa-modulo_cyclic-" in out.stdout
    assert not (tmp_path / "runs").exists()


def test_slurm_launcher_without_slurm_is_one_line(tmp_path):
    if shutil.which("srun"):
        pytest.skip("SLURM is installed on this machine (tests/slurm/setup.sh)")
    for args in (["-m", "hydra/launcher=submitit_slurm"], ["-m", "hardware=slurm_1node_8gpu"]):
        out = cli([*args, "trainer.steps=1"], tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.count("\n") == 1 and "no SLURM on this machine (srun not found)" in out.stderr
        assert list(tmp_path.iterdir()) == []
