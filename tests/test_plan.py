"""`python -m trmoe.plan`: the figures of a run plan, from the real config composition; the FLOPs formula
against torch's FLOP counter; the activation estimate against the tensors autograd really saves."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import cli, compose_config
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from trmoe.config.derived import global_batch_tokens
from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.loss.tied import chunked_tied_ce
from trmoe.model.flops import flops_breakdown
from trmoe.model.transformer import TRMoETransformer, count_parameters
from trmoe.plan.__main__ import _bytes as _bytes_text
from trmoe.plan.__main__ import main, render
from trmoe.plan.build import Throughput, make_plan, parse_count
from trmoe.plan.memory import layer_activation_bytes

aten = torch.ops.aten


def test_parameter_counts_are_the_known_figures():
    p100 = make_plan(["model=100m"])["model"]["params"]
    assert p100["total"] == 99_672_020 and p100["active"] == 98_934_740
    assert p100["non_embedding"] == p100["total"] - p100["embedding"]
    assert p100["active_non_embedding"] == p100["active"] - p100["embedding"]
    assert make_plan(["model=8b"])["model"]["params"]["total"] == 8_201_527_360  # meta device: instant


def test_tokens_per_step_of_a_slurm_preset_is_nodes_x_tasks_x_micro_x_seq_x_accum():
    overrides = [
        "hardware=slurm_4node_8gpu",
        "trainer.micro_batch=3",
        "trainer.seq_len=96",
        "trainer.grad_accum=5",
    ]
    plan = make_plan(overrides)
    assert plan["hardware"]["world"] == 4 * 8
    assert plan["batch"]["tokens_per_step"] == 3 * 96 * 32 * 5
    # the same function the train loop uses
    assert plan["batch"]["tokens_per_step"] == global_batch_tokens(
        to_config(compose_config(*overrides)).trainer, 32
    )
    assert plan["hardware"]["strategy"] == "ddp"
    assert make_plan([*overrides, "hydra.launcher.nodes=2"])["batch"]["tokens_per_step"] == 3 * 96 * 16 * 5
    # torchrun: --world; no launcher and no --world: one process
    assert make_plan(["trainer.micro_batch=2"], world=6)["batch"]["tokens_per_step"] == 2 * 128 * 6
    single = make_plan(["trainer.micro_batch=2"])
    assert single["hardware"]["world"] == 1 and single["hardware"]["strategy"] == "none"


def test_steps_are_the_ceiling_of_target_over_tokens_per_step():
    base = ["hardware=slurm_1node_8gpu", "trainer.micro_batch=4", "trainer.seq_len=256"]
    tps = 4 * 256 * 8
    target = 1_000_000_007
    run = make_plan(base, tokens=target)["run"]
    assert run["steps"] == math.ceil(target / tps) and run["tokens"] == run["steps"] * tps
    assert (run["steps"] - 1) * tps < target <= run["tokens"]
    assert run["launch"].endswith(f"trainer.steps={run['steps']}") and "--multirun" in run["launch"]
    assert make_plan(base, tokens=7 * tps)["run"]["steps"] == 7  # exact multiple: no extra step
    no_target = make_plan([*base, "trainer.steps=123"])["run"]
    assert no_target["steps"] == 123 and no_target["tokens"] == 123 * tps


def _total(plan: dict) -> int:
    return plan["memory"]["total_bytes"]


def _item(plan: dict, what: str) -> int:
    return next(i["bytes"] for i in plan["memory"]["items"] if i["what"] == what)


def test_fsdp_memory_per_gpu_shrinks_with_world_and_ddp_does_not():
    fsdp = [
        "model=1b",
        "hardware=cuda",
        "hardware.strategy=fsdp",
        "trainer.micro_batch=2",
        "trainer.seq_len=512",
    ]
    f8, f32 = make_plan(fsdp, world=8), make_plan(fsdp, world=32)
    assert f8["memory"]["strategy"] == "fsdp" and _total(f32) < _total(f8)
    p = f8["model"]["params"]["total"]
    assert _item(f8, "parameters") == 4 * p // 8 and _item(f32, "parameters") == 4 * p // 32
    assert _item(f8, "optimizer state") == 8 * p // 8  # AdamW: two fp32 states, sharded
    assert _item(f8, "activations") == _item(f32, "activations")  # per micro-batch, not sharded
    ddp = [
        "model=1b",
        "hardware=cuda",
        "hardware.strategy=ddp",
        "trainer.micro_batch=2",
        "trainer.seq_len=512",
    ]
    d8, d32 = make_plan(ddp, world=8), make_plan(ddp, world=32)
    assert d8["memory"]["strategy"] == "ddp" and _total(d8) == _total(d32) > _total(f8)
    assert _item(d8, "parameters") == _item(d8, "DDP gradient buckets") == 4 * p
    # fp32 compute on CPU: no low-precision weight copies, and activations are larger than under bf16
    cpu = make_plan(["model=1b", "hardware=cpu", "trainer.micro_batch=2", "trainer.seq_len=512"], world=8)
    assert "low-precision weights" not in {i["what"] for i in cpu["memory"]["items"]}
    assert _item(cpu, "activations") > _item(d8, "activations")


def test_optimizer_state_follows_the_optimizer():
    adamw = make_plan(["model=100m"])
    muon = make_plan(["model=100m", "optimizer=muon_tr"])
    p = adamw["model"]["params"]["total"]
    assert _item(adamw, "optimizer state") == 8 * p
    assert _item(make_plan(["model=100m", "optimizer=stosignsgd"]), "optimizer state") == 8 * p
    # Muon keeps one momentum buffer on the routed expert matrices (muon_scope=experts), AdamW's two elsewhere
    spec = model_spec(to_config(compose_config("model=100m")))
    experts = spec.num_layers * 3 * spec.hidden_size * spec.routed_width
    assert _item(muon, "optimizer state") == 8 * p - 4 * experts


def _flop_mapping() -> dict:
    """torch's FlopCounterMode counts mm/addmm; the grouped expert GEMM and CPU flash attention are added."""

    def grouped(a, b, *args, out_shape=None, **kwargs):
        return 2 * a[0] * a[1] * b[-1]  # every row of a times its group's [A, B] matrix

    def attn(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def attn_backward(grad, q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad, q, k, v)

    return {
        aten._grouped_mm: grouped,
        aten._scaled_dot_product_flash_attention_for_cpu: attn,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: attn_backward,
    }


@pytest.mark.parametrize(
    "variant",
    [
        (),
        ("attention=mha",),
        ("attention=mqa", "routing.top_k=1"),
        ("model.num_experts=1", "routing.top_k=1"),
        ("routing.layers=[{first: 1, last: 1, strategy: dense}]",),
    ],
    ids=["tiny-gqa-top2", "mha", "mqa-top1", "dense-control", "dense-layer"],
)
def test_flops_per_token_equal_torch_flop_counter_per_profile(variant):
    """model/flops.py against torch.utils.flop_counter.FlopCounterMode on a real forward and backward, per
    attention kind and FFN shape of the tiny profile: the GEMMs exactly; attention as documented (the
    counter counts SDPA's full S x S square, forward and backward; the formula x3 for the backward and
    halved for the causal mask)."""
    spec = model_spec(to_config(compose_config("model=tiny", "trainer.seq_len=32", *variant)))
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    batch, seq = 2, 32
    ids = torch.randint(0, spec.vocab_size, (batch, seq + 1))
    with FlopCounterMode(display=False, custom_mapping=_flop_mapping()) as counter:
        hidden = model(ids[:, :-1])
        chunked_tied_ce(hidden, model.head_weight, ids[:, 1:], chunk_tokens=16).total.backward()
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    tokens = batch * seq
    flops = flops_breakdown(spec, count_parameters(model), seq)
    # GEMMs (attention and FFN weights, the routed experts a token visits, the tied head's three GEMMs):
    # exactly 6 x active non-embedding + 6 x H x V, less the 6 x vector parameters (norms, gates: no GEMM)
    gemm = sum(n for op, n in counted.items() if "attention" not in op)
    vectors = sum(p.numel() for p in model.parameters() if p.ndim < 2)
    assert gemm == tokens * (flops.dense + flops.head - 6 * vectors)
    assert flops.head == 6 * spec.hidden_size * spec.embedding_rows
    # attention: the counter's forward covers the full S x S square (QK^T and AV); the formula is x3 for the
    # backward and halved for the causal mask
    forward = counted["aten._scaled_dot_product_flash_attention_for_cpu"]
    assert flops.attention * tokens * 2 == forward * 3
    assert flops.total == flops.dense + flops.attention + flops.head


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor, amp: bool) -> int:
    """Bytes of the distinct storages autograd saves for the backward (parameters and buffers excluded)."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            model(ids)
    return sum(seen.values())


@pytest.mark.parametrize(
    "overrides,amp",
    [
        ([], False),
        (["attention.qk_norm=false", "model.gates=false", "routing.top_k=3", "attention=mha"], False),
        (["model.shared_width=0"], False),
        (["trainer.shared_chunk_tokens=32"], False),
        (["model.num_experts=1", "routing.top_k=1"], False),
        (["model.num_experts=1", "routing.top_k=1"], True),  # CPU autocast covers the dense path
        (["routing.layers=[{first: 0, last: 0, strategy: dense}]"], False),  # a dense layer, a routed one
        (["routing.layers=[{first: 1, last: 1, strategy: dense}]", "trainer.shared_chunk_tokens=32"], False),
    ],
)
def test_activation_estimate_matches_what_autograd_saves(overrides, amp):
    cfg = to_config(compose_config("model=tiny", "model.vocab_size=512", *overrides))
    spec = model_spec(cfg)
    model = TRMoETransformer(spec)
    for block in model.blocks:
        if block.ffn.shared is not None:
            block.ffn.shared.chunk_tokens = cfg.trainer.shared_chunk_tokens
    seq = 64
    # per token: the difference of two batch sizes cancels what does not scale with tokens (weight casts)
    small = _saved_bytes(model, torch.randint(0, 512, (2, seq)), amp)
    large = _saved_bytes(model, torch.randint(0, 512, (4, seq)), amp)
    measured = (large - small) / (2 * seq)
    chunked = cfg.trainer.shared_chunk_tokens > 0
    layers = sum(layer_activation_bytes(spec, 2 if amp else 4, chunked, i) for i in range(spec.num_layers))
    expected = layers + 2 * 4 * spec.hidden_size
    assert measured == pytest.approx(expected, rel=0.04), "trmoe.plan.memory.layer_activation_bytes is stale"


def test_throughput_gives_the_eta_and_mfu():
    base = ["model=100m", "hardware=slurm_1node_8gpu", "trainer.micro_batch=4", "trainer.seq_len=1024"]
    plan = make_plan(base, tokens=10**9, throughput=Throughput(tok_s_per_gpu=50_000, peak_flops=989e12))
    t, per_token = plan["time"], plan["flops"]["per_token"]["total"]
    assert t["tok_s"] == 8 * 50_000 and t["eta_s"] == pytest.approx(plan["run"]["tokens"] / 400_000)
    assert t["mfu"] == pytest.approx(per_token * 50_000 / 989e12)
    assert plan["flops"]["total"] == per_token * plan["run"]["tokens"]
    mfu = make_plan(base, throughput=Throughput(mfu=0.4, peak_flops=989e12))["time"]
    assert mfu["tok_s_per_gpu"] == pytest.approx(0.4 * 989e12 / per_token) and mfu["mfu"] == pytest.approx(
        0.4
    )
    none = make_plan(base)["time"]
    assert (
        none["tok_s"] is None
        and "python -m trmoe.bench step --model 100m --batch 4 --seq 1024" in (none["how_to_measure"])
    )
    text = render(plan)
    assert "tokens per step" in text and "ETA" in text and "8 x 4096" not in text
    # an aligned table: the values of all rows end in one column
    lines = text.splitlines()
    values = [
        f"{plan['model']['params']['total']:,}",
        f"{plan['batch']['tokens_per_step']:,}",
        f"{plan['run']['steps']:,}",
        _bytes_text(plan["memory"]["total_bytes"]),
    ]
    ends = {next(ln.index(f" {v}  ") + 1 + len(v) for ln in lines if f" {v}  " in ln) for v in values}
    assert len(ends) == 1


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["model=tiny", "--tokens", "-5"], "--tokens"),
        (["model=tiny", "--tokens", "abc"], "--tokens"),
        (["model=tiny", "--world", "0"], "--world: '0' is not a positive whole number; allowed: e.g. 8, 64"),
        (["model=tiny", "--mfu", "2", "--peak-tflops", "989"], "--mfu"),
        (["model=tiny", "--mfu", "0.4"], "--peak-tflops"),
        (["model=tiny", "--tok-s", "5", "--mfu", "0.4"], "one throughput"),
        (["model=tiny", "--frobnicate"], "unrecognized"),
        (["trainer.foo=1"], "trainer.foo"),
        (["model=nope"], "allowed: 100m"),
        (["trainer.steps=abc"], "trainer.steps"),
        (["hardware=slurm_4node_8gpu", "--world", "8"], "32"),
        (["trainer.steps=5", "--tokens", "1e6"], "trainer.steps"),
        (["trainer.micro_batch=0"], "trainer.micro_batch"),
        (["hardware=cpu", "hardware.precision=bf16"], "hardware.precision"),
        # numbers beyond what a float holds: no OverflowError / decimal.Overflow traceback
        (["model=tiny", "--tokens", "1e400"], "--tokens: '1e400' is too large; allowed: at most 1e18"),
        (["model=tiny", "--world", "1e400"], "--world: '1e400' is too large"),
        (["model=tiny", "--tokens", "1e999999999"], "--tokens: '1e999999999' is not a positive whole number"),
        (["model=tiny", "--tokens", "1e18", "--tok-s", "1e-300"], "--tok-s: the step time, ETA or FLOP/s"),
        (["model=tiny", "--mfu", "1", "--peak-tflops", "1e300"], "--mfu, --peak-tflops: "),
        # the launcher's counts: neither a negative world nor a silent 1 for 0
        (["hardware=slurm_local_test", "hydra.launcher.nodes=-3"], "hydra.launcher.nodes=-3: must be"),
        (["hardware=slurm_local_test", "hydra.launcher.nodes=0"], "hydra.launcher.nodes=0: must be"),
        (
            ["hardware=slurm_local_test", "hydra.launcher.tasks_per_node=-1", "--tokens", "1B"],
            "hydra.launcher.tasks_per_node=-1: must be a positive",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, fragment, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trmoe: ") and fragment in err


def test_parse_count_accepts_the_usual_spellings():
    assert parse_count("--tokens", "20e9") == parse_count("--tokens", "20B") == 20_000_000_000
    assert parse_count("--tokens", "2.5T") == 2_500_000_000_000 and parse_count("--tokens", "1_000") == 1000


def test_cli_prints_json_writes_nothing_and_bad_input_exits_2(tmp_path):
    # options may come between the overrides
    done = cli(
        ["model=1b", "--tokens", "20e9", "hardware=slurm_4node_8gpu", "--json"],
        tmp_path,
        module="trmoe.plan",
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["model"]["params"]["total"] == 1_030_812_200 and plan["hardware"]["world"] == 32
    assert plan["run"]["steps"] == math.ceil(20e9 / plan["batch"]["tokens_per_step"])
    bad = cli(["model=1b", "trainer.nope=1"], tmp_path, module="trmoe.plan")
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no run directory, no outputs/, no .hydra


def test_durations_under_a_second_are_given_in_milliseconds():
    from trmoe.plan.__main__ import _duration

    assert (_duration(0.0068), _duration(0.25), _duration(42.0)) == ("6.8 ms", "250 ms", "42.0 s")


# ------------------------------------------------------------------ the launch's wall-time estimate


def test_the_wall_time_bound_is_the_planners_flops_over_the_peak():
    """trmoe.plan.walltime: steps x tokens per step x the plan's FLOPs per token / the peak (here given)."""
    from trmoe.plan.walltime import estimate

    overrides = ["model=100m", "trainer.steps=954", "hardware.device=cpu", "hardware.peak_tflops=0.5"]
    cfg = to_config(compose_config(*overrides))
    wall = estimate(cfg, model_spec(cfg), torch.device("cpu"), None, cfg.trainer.steps)
    per_token = make_plan(overrides)["flops"]["per_token"]["total"]
    assert wall.flops_per_token == per_token
    assert wall.seconds == pytest.approx(954 * global_batch_tokens(cfg.trainer, 1) * per_token / 0.5e12)
    assert wall.source == "hardware.peak_tflops"


def test_experiment_routing_ablation_on_a_cpu_is_refused_in_one_line_with_its_estimate(tmp_path):
    """The slip of issue 46: the full grid (100m arms, 1M tokens a step) where its _smoke was meant. Every
    job is estimated before any starts; the sweep is refused before Hydra writes its folder."""
    import re
    import time

    started = time.perf_counter()
    result = cli(["experiment=routing_ablation", "hardware.device=cpu"], cwd=tmp_path)
    took = time.perf_counter() - started
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("trmoe: config error: trainer.max_hours=24: this run needs at least "), line
    assert "954 steps x 1,048,576 tokens" in line and "measured 1024^3 float32 GEMM" in line
    assert re.search(r"at least \d+ d ", line)  # days of work, on any CPU this suite runs on
    assert re.search(r"trainer\.max_hours=\d+ \(null: no limit\) to accept it", line)
    assert line.endswith("nothing was launched") and "[sweep job 0: " in line
    assert list(tmp_path.rglob("*")) == []
    # one step of it takes hours here: a refusal before training is orders of magnitude below that
    assert took < 120, took


def test_a_ladder_sweep_is_estimated_on_its_jobs_runs_not_on_trainer_steps(tmp_path):
    """A ladder job's own trainer.steps is unset (the ladder sets each run's): the estimate counts the job's
    stable run and its branches' decays (trmoe.config.ladder.LadderPlan.job_steps). Before, the sweep check
    passed on the default 150 steps and every job made its folder, then refused its stable run."""
    from trmoe.config.derived import global_batch_tokens
    from trmoe.config.ladder import plan

    cfg = to_config(compose_config("experiment=ladder", "ladder.rung=3", "hardware.device=cpu"))
    lp = plan(cfg, global_batch_tokens(cfg.trainer, 1))
    assert lp.job_steps == lp.stable_steps + sum(b.steps - b.branch_step for b in lp.budgets) > 100_000
    result = cli(["experiment=ladder", "ladder.rung=3", "hardware.device=cpu"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"({lp.job_steps:,} steps x 4,096 tokens" in lines[0], lines
    assert "ladder budgets" in lines[0] and lines[0].endswith("nothing was launched")
    assert list(tmp_path.rglob("*")) == []


def test_a_single_run_over_the_limit_is_refused_and_the_named_override_accepts_it(tmp_path):
    """A run refused in one line (exit 2, nothing written) names the trainer.max_hours that accepts it; that
    launch runs, and its train.log holds the estimate it logged before step 1."""
    import re

    tiny = ["model=tiny", "trainer.steps=2", "trainer.micro_batch=2", "trainer.seq_len=32", "run.name=r"]
    refused = cli([*tiny, "hardware.device=cpu", "trainer.max_hours=1e-9"], cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "trainer.max_hours=1e-09: this run needs at least" in refused.stderr
    assert list(tmp_path.rglob("*")) == []
    accept = re.search(r"(trainer\.max_hours=\d+) \(null: no limit\)", refused.stderr).group(1)
    done = cli([*tiny, "hardware.device=cpu", accept], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "runs" / "r" / "train.log").read_text()
    before_step_1 = log.split("step 1", 1)[0] if "step 1" in log else log
    assert re.search(r"estimated wall time: at least .* on this cpu \(2 steps x 64 tokens", before_step_1)


def test_max_hours_null_is_no_limit_and_zero_is_refused(tmp_path):
    from trmoe.plan.walltime import check_config

    for value, limited in (("null", False), ("24", True)):  # (150 steps of 1,024 tokens: within 24 h)
        cfg = to_config(compose_config("model=100m", "hardware.device=cpu", f"trainer.max_hours={value}"))
        assert (check_config(cfg) is not None) == limited
    bad = cli(["trainer.max_hours=0"], cwd=tmp_path)
    assert bad.returncode == 2 and "trainer.max_hours=0" in bad.stderr and "null for no limit" in bad.stderr
    assert list(tmp_path.rglob("*")) == []
