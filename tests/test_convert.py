"""python -m trmoe.convert reference: a checkpoint in the old runner's layout (the fact sheet's key names,
shapes and config keys), built here from a trmoe model of our own, becomes a trmoe run directory whose model
gives the same logits; settings trmoe cannot express are refused with one line naming them."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from helpers import cli, compose_config

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.convert import primary_weight
from trmoe.model.transformer import TRMoETransformer
from trmoe.run.checkpoint import load_checkpoint

V, H, L, HEADS, KV, SHARED, E, IE = 1000, 64, 3, 4, 2, 96, 4, 8


def _trmoe_model(routing: str = "balanced_hash_all_tuples") -> TRMoETransformer:
    """The fact sheet's conversion check (1.8): V 1,000, H 64, L 3, heads 4/2, shared 96, routed 4 x 8, K 2,
    gates on with random values, the routed scale interpolated 1.2 -> 2.0 over depth."""
    cfg = compose_config(
        "model=tiny",
        f"model.vocab_size={V}",
        f"model.hidden_size={H}",
        f"model.num_layers={L}",
        f"model.num_heads={HEADS}",
        f"model.num_kv_heads={KV}",
        f"model.shared_width={SHARED}",
        f"model.routed_width={E * IE}",
        "model.routed_scale=1.2",
        "model.routed_scale_last=2.0",
        f"routing={routing}",
        "routing.primary_weight=0.85",
    )
    torch.manual_seed(0)
    model = TRMoETransformer(model_spec(to_config(cfg)))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim < 2:  # norms and gates: random values, not their init
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def _reference_checkpoint(model: TRMoETransformer, **config_changes) -> dict:
    """The model in the old runner's layout: separate q/k/v, gate/up split, nn.Linear shared expert, int64
    route tables with token_to_expert, persistent inv_freq; its config and args as the runner records them."""
    spec, state = model.spec, model.state_dict()
    d = spec.head_dim
    ref = {"embed_tokens.weight": state["embed.weight"].clone(), "norm.weight": state["norm.weight"].clone()}
    for layer in range(L):
        t, r = f"blocks.{layer}.", f"layers.{layer}."
        q, k, v = state[t + "attn.qkv.weight"].split([HEADS * d, KV * d, KV * d])
        ref |= {
            r + "input_layernorm.weight": state[t + "attn_norm.weight"],
            r + "self_attn.q_proj.weight": q,
            r + "self_attn.k_proj.weight": k,
            r + "self_attn.v_proj.weight": v,
            r + "self_attn.o_proj.weight": state[t + "attn.out.weight"],
            r + "self_attn.q_norm.weight": state[t + "attn.q_norm.weight"],
            r + "self_attn.k_norm.weight": state[t + "attn.k_norm.weight"],
            r + "self_attn.rotary_emb.inv_freq": 1.0 / 10_000.0 ** (torch.arange(0, d, 2).float() / d),
            r + "post_attention_layernorm.weight": state[t + "ffn_norm.weight"],
        }
        m = r + "mlp."
        gate, up = state[t + "ffn.routed.w_in"].chunk(2, dim=2)
        sg, su = state[t + "ffn.shared.w_in"].chunk(2, dim=1)
        table = state[t + "ffn.routed.route_table"].long()
        ref |= {
            m + "gate_proj_w": gate.contiguous(),
            m + "up_proj_w": up.contiguous(),
            m + "down_proj_w": state[t + "ffn.routed.w_out"],
            m + "shared_output_gate": state[t + "ffn.shared_gate"],
            m + "routed_output_gate": state[t + "ffn.routed_gate"],
            m + "token_to_expert": table[0].clone(),
            m + "topk_token_to_expert": table,
            m + "shared_gate.weight": sg.T.contiguous(),
            m + "shared_up.weight": su.T.contiguous(),
            m + "shared_down.weight": state[t + "ffn.shared.w_out"].T.contiguous(),
        }
    config = {
        "hidden_size": H,
        "num_hidden_layers": L,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "intermediate_size": E * IE,
        "shared_intermediate_size": SHARED,
        "num_experts": E,
        "attention_type": "gqa",
        "mlp_type": "token_routed",
        "shared_expert": True,
        "use_shared_routed_gates": True,
        "shared_output_scale": 1.0,
        "routed_output_scale": 1.0,
        "routed_output_scale_first_layer": 1.2,
        "routed_output_scale_last_layer": 2.0,
        "top_k": 2,
        "top_k_primary_weight": 0.5,  # the schedule's start value: not what step 3 trained with
        "routing_strategy": "token_id_balanced_hash",
        "token_frequencies": None,
        "vocab_size": V,
        "norm_eps": 1e-6,
        "rope_theta": 10_000.0,
        "use_qk_norm": True,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "expert_initialization": "gpt_normal",
    } | config_changes
    args = {"profile": "tiny", "steps": 3, "top_k_primary_weight": 0.5, "top_k_primary_weight_final": 0.85}
    args["top_k_primary_weight_schedule_ratio"] = 0.5  # R = floor(3 * 0.5) = 1 <= 1: p = final from step 1
    return {
        "step": 3,
        "model": ref,
        "optimizer": {},
        "scheduler": {},
        "config": config,
        "args": args,
        "backend": {},
    }


def test_primary_weight_follows_the_runners_schedule():
    args = {"top_k_primary_weight": 0.5, "top_k_primary_weight_final": 0.85, "steps": 100}
    args["top_k_primary_weight_schedule_ratio"] = 0.5  # R = 50
    assert primary_weight(args, 1, 2) == 0.5
    assert primary_weight(args, 26, 2) == pytest.approx(0.5 + 0.35 * (0.5 - 0.5 * math.cos(math.pi * 0.5)))
    assert primary_weight(args, 80, 2) == 0.85
    assert primary_weight({**args, "steps": 3}, 1, 2) == 0.85  # R = 1: the final value outright
    assert primary_weight(args, 80, 1) == 1.0
    # a ratio above 1 is clamped to 1 as the runner does: R = 100, not floor(100 * 2) = 200
    clamped = {**args, "top_k_primary_weight_schedule_ratio": 2.0}
    assert primary_weight(clamped, 23, 2) == pytest.approx(
        0.5 + 0.35 * (0.5 - 0.5 * math.cos(math.pi * 0.22))
    )
    assert primary_weight(clamped, 101, 2) == 0.85


def test_a_converted_reference_checkpoint_gives_the_same_logits(tmp_path):
    model = _trmoe_model()
    torch.save(_reference_checkpoint(model), tmp_path / "checkpoint.pt")
    out = cli(
        ["reference", str(tmp_path / "checkpoint.pt"), "--out", "runs/ref"], tmp_path, module="trmoe.convert"
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "runs" / "ref"
    record = json.loads((run_dir / "run_config.json").read_text())
    assert record["converted_from"]["primary_weight"] == 0.85 and record["converted_from"]["step"] == 3
    assert record["model_spec"]["strategy"] == "balanced_hash_all_tuples"
    assert record["params"]["total"] == sum(p.numel() for p in model.parameters())
    overrides = (run_dir / "overrides.txt").read_text().split()
    spec = model_spec(to_config(compose_config(*overrides)))
    assert spec == model_spec(to_config(compose_config(*record_overrides(record))))
    converted = TRMoETransformer(spec)
    converted.load_state_dict(load_checkpoint(run_dir)["model"])
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.logits(model(ids))
        got = converted.logits(converted(ids))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # negative control: swapping the two route rows changes the logits
    with torch.no_grad():
        routed = converted.blocks[0].ffn.routed
        routed.set_route_table(routed.route_table.flip(0))
        assert (converted.logits(converted(ids)) - want).abs().max() > 1e-4


def record_overrides(record: dict) -> list[str]:
    """The config run_config.json recorded, as overrides (it must be the one overrides.txt composes)."""
    m, r, a = record["config"]["model"], record["config"]["routing"], record["config"]["attention"]
    keys = [
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "shared_width",
        "routed_width",
        "vocab_size",
    ]
    out = ["model=tiny", *(f"model.{k}={m[k]}" for k in keys), f"model.routed_scale={m['routed_scale']}"]
    out += [f"model.routed_scale_last={m['routed_scale_last']}", f"routing={r['strategy']}"]
    return out + [f"routing.primary_weight={r['primary_weight']}", f"attention={a['kind']}"]


@pytest.mark.parametrize(
    ("change", "setting"),
    [
        ({"routing_strategy": "lsh_hidden"}, "routing_strategy='lsh_hidden'"),
        ({"mlp_type": "swiglu"}, "mlp_type='swiglu'"),
        ({"attention_type": "tr_mha"}, "attention_type='tr_mha'"),
        ({"use_qk_norm": False}, "use_qk_norm=False"),
        ("pair_gates", "learn_hash_pair_gates=True"),
    ],
)
def test_settings_trmoe_cannot_express_are_refused_by_name(tmp_path, change, setting):
    model = _trmoe_model()
    if change == "pair_gates":
        ckpt = _reference_checkpoint(model)
        ckpt["model"]["layers.0.mlp.hash_pair_gate_logits"] = torch.zeros(6)
    else:
        ckpt = _reference_checkpoint(model, **change)
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    out = cli(
        ["reference", str(tmp_path / "checkpoint.pt"), "--out", "runs/x"], tmp_path, module="trmoe.convert"
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and setting in lines[0] and "cannot be expressed in trmoe" in lines[0], out.stderr
    assert not (tmp_path / "runs").exists()


def _drop(mapping: dict, key: str) -> None:
    del mapping[key]


def _reshape(state: dict, key: str) -> None:
    state[key] = state[key][:-1].clone()


MALFORMED = {  # what is wrong -> (how to break the file, what the one line must name)
    "no model": (lambda c: _drop(c, "model"), "'model'"),
    "no config": (lambda c: _drop(c, "config"), "'config'"),
    "no args": (lambda c: _drop(c, "args"), "'args'"),
    "no args.steps": (lambda c: _drop(c["args"], "steps"), "'steps'"),
    "config without hidden_size": (lambda c: _drop(c["config"], "hidden_size"), "config.hidden_size"),
    "missing tensor": (lambda c: _drop(c["model"], "layers.1.mlp.down_proj_w"), "layers.1.mlp.down_proj_w"),
    "wrong shape": (lambda c: _reshape(c["model"], "layers.2.self_attn.q_proj.weight"), "q_proj.weight"),
    "float route table": (
        lambda c: c["model"].update({"layers.0.mlp.topk_token_to_expert": torch.zeros(2, V)}),
        "topk_token_to_expert",
    ),
    "fewer layers in config": (lambda c: c["config"].update(num_hidden_layers=L - 1), "num_hidden_layers"),
    "more layers in config": (lambda c: c["config"].update(num_hidden_layers=L + 1), f"layers.{L}."),
    "zero heads": (lambda c: c["config"].update(num_attention_heads=0), "config.num_attention_heads=0"),
    "negative step": (lambda c: c.update(step=-5), "step=-5"),
    "fractional step": (lambda c: c.update(step=2.5), "step"),
}


@pytest.mark.parametrize("flaw", list(MALFORMED))
def test_a_malformed_checkpoint_is_one_line_exit_2_and_nothing_written(tmp_path, flaw):
    """Each kind of malformed file (absent keys, tensors of the wrong shape or kind, a config that
    disagrees with the tensors, impossible sizes, a bad step, no args) is refused by name before a write."""
    ckpt = _reference_checkpoint(_trmoe_model())
    breaks, named = MALFORMED[flaw]
    breaks(ckpt)
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    out = cli(
        ["reference", str(tmp_path / "checkpoint.pt"), "--out", "runs/x"], tmp_path, module="trmoe.convert"
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and named in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_an_out_that_cannot_be_written_is_one_line_before_the_load(tmp_path, tmpfs, capsys):
    """A read-only place for the converted run directory: one line, exit 2 (a tool's output place, which
    --out moves), not a traceback from the staging directory."""
    from trmoe.convert import main

    torch.save(_reference_checkpoint(_trmoe_model()), tmp_path / "checkpoint.pt")
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    assert main(["reference", str(tmp_path / "checkpoint.pt"), "--out", str(tmpfs / "x")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"trmoe: convert: --out {tmpfs / 'x'}: {tmpfs} is not writable; choose a new run directory where one "
        "can be written"
    ]


def test_init_from_a_converted_checkpoint_starts_training(tmp_path):
    """trainer.init_from=<the converted run>: a new run from its weights (the converted run untouched); it
    holds no optimizer or train state, so only init_state=weights is allowed (one line, exit 2)."""
    from helpers import tree_digest

    torch.save(_reference_checkpoint(_trmoe_model()), tmp_path / "checkpoint.pt")
    cli(["reference", str(tmp_path / "checkpoint.pt"), "--out", "runs/ref"], tmp_path, module="trmoe.convert")
    run_dir, before = tmp_path / "runs" / "ref", tree_digest(tmp_path / "runs" / "ref")
    overrides = (run_dir / "overrides.txt").read_text().split()
    tiny = ["data=random", "hardware=cpu", "hardware.threads=1", "trainer.seq_len=16"]
    tiny += ["trainer.micro_batch=2", "trainer.steps=2", "trainer.eval_batches=1", "run.name=ft"]
    tiny.append(f"trainer.init_from={run_dir}")
    refused = cli([*overrides, *tiny, "trainer.init_state=branch"], tmp_path)
    assert refused.returncode == 2 and "converted checkpoint" in refused.stderr, refused.stderr
    assert not (tmp_path / "runs" / "ft").exists()
    out = cli([*overrides, *tiny], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "runs" / "ft" / "run_config.json").read_text())["init_from"]
    assert record["kind"] == "converted" and record["step"] == 3
    first = load_checkpoint(tmp_path / "runs" / "ft")
    assert first["step"] == 2 and all(torch.isfinite(v).all() for v in first["model"].values())
    assert tree_digest(run_dir) == before


def _convert(tmp_path, ckpt: dict) -> subprocess.CompletedProcess:
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    return cli(
        ["reference", str(tmp_path / "checkpoint.pt"), "--out", "runs/ref"], tmp_path, module="trmoe.convert"
    )


def test_overrides_carry_the_runs_own_p_target_past_the_compat_preset(tmp_path):
    """A run saved halfway up its ramp toward 0.9: overrides.txt starts p where the run stood and keeps the
    run's target and ramp share, also under compat=old_runner (whose 0.85 target it would otherwise get)."""
    from trmoe.optim.schedule import build_schedules

    ckpt = _reference_checkpoint(_trmoe_model())
    ckpt["step"] = 30
    ckpt["args"] |= {"steps": 100, "top_k_primary_weight_final": 0.9}
    ckpt["args"]["top_k_primary_weight_schedule_ratio"] = 0.4
    out = _convert(tmp_path, ckpt)
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "runs" / "ref"
    p = 0.5 + 0.4 * (0.5 - 0.5 * math.cos(math.pi * 29 / 40))  # the runner's p at step 30 (R = 40)
    record = json.loads((run_dir / "run_config.json").read_text())["converted_from"]
    assert record["primary_weight_final"] == 0.9
    overrides = (run_dir / "overrides.txt").read_text().split()
    for preset in ([], ["compat=old_runner"]):
        cfg = to_config(compose_config(*preset, *overrides, "data=random", "trainer.steps=50"))
        ramp = build_schedules(cfg).primary_weight
        assert (ramp.start, ramp.final, ramp.steps) == (pytest.approx(p), 0.9, 20), preset


WRONG_TYPES = ([1], "x", True, float("nan"))  # a list, a string, a bool, a number that is not finite
# keys the conversion does not read (num_key_value_heads lies, fact sheet 1.6; p comes from args, not from
# the start value in config; only the presence of token_frequencies counts): any value converts
UNREAD = {"config.num_key_value_heads", "config.token_frequencies", "config.top_k_primary_weight"}


def _type_cases() -> list[tuple[str, str, object]]:
    ckpt = _reference_checkpoint(_trmoe_model())
    cases = []
    for part in ("config", "args"):
        for key, good in ckpt[part].items():
            for wrong in WRONG_TYPES:
                if type(wrong) is not type(good) or wrong != wrong:  # another type, or nan for a number
                    cases.append((part, key, wrong))
    return cases


@pytest.mark.parametrize(("part", "key", "wrong"), _type_cases(), ids=lambda v: repr(v)[:24])
def test_a_value_of_the_wrong_type_anywhere_in_config_or_args_is_one_line(tmp_path, part, key, wrong):
    """Every key of the file's config and args, set to a value of another type: one line naming the key,
    exit 2, nothing written — or, for a key the conversion never reads, a conversion as if it were not."""
    ckpt = _reference_checkpoint(_trmoe_model())
    ckpt[part][key] = wrong
    out = _convert(tmp_path, ckpt)
    assert "Traceback" not in out.stderr
    if f"{part}.{key}" in UNREAD or (key == "profile" and wrong == "x"):
        assert out.returncode == 0, out.stderr
        return
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and f"{part}.{key}" in lines[0], out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


MODEL_FLAWS = {  # a wrong type among the tensors -> what the one line names
    "a key that is not a string": (lambda m: m.update({7: torch.zeros(2)}), "7"),
    "a list for a tensor": (lambda m: m.update({"norm.weight": [1.0]}), "norm.weight"),
    "a sparse tensor": (lambda m: m.update({"norm.weight": m["norm.weight"].to_sparse()}), "norm.weight"),
    "inv_freq of another length": (
        lambda m: m.update({"layers.1.self_attn.rotary_emb.inv_freq": torch.ones(3)}),
        "inv_freq",
    ),
    "inv_freq of integers": (
        lambda m: m.update({"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(H // HEADS // 2).long()}),
        "inv_freq",
    ),
    "token_to_expert of floats": (
        lambda m: m.update({"layers.0.mlp.token_to_expert": torch.zeros(V)}),
        "token_to_expert",
    ),
    "a bool route table": (
        lambda m: m.update({"layers.2.mlp.topk_token_to_expert": torch.zeros(2, V, dtype=torch.bool)}),
        "topk_token_to_expert",
    ),
    "a bool hash channel scale": (
        lambda m: m.update({"layers.0.mlp.hash_channel_scale": torch.zeros(H, dtype=torch.bool)}),
        "hash_channel_scale",
    ),
}


@pytest.mark.parametrize("flaw", list(MODEL_FLAWS))
def test_a_wrong_type_among_the_tensors_is_one_line(tmp_path, flaw):
    ckpt = _reference_checkpoint(_trmoe_model())
    breaks, named = MODEL_FLAWS[flaw]
    breaks(ckpt["model"])
    out = _convert(tmp_path, ckpt)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and named in lines[0], out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


@pytest.mark.parametrize("profile", ["100m o200k", "a\tb", "x=y", "a,b", ""])
def test_a_profile_name_overrides_txt_cannot_hold_is_one_line(tmp_path, profile):
    """args.profile names the model in overrides.txt (one shell word, one Hydra value): a blank, '=' or ','
    would split or change the override; '' falls back to 'checkpoint' and converts."""
    ckpt = _reference_checkpoint(_trmoe_model())
    ckpt["args"]["profile"] = profile
    out = _convert(tmp_path, ckpt)
    if profile == "":
        assert out.returncode == 0, out.stderr
        overrides = (tmp_path / "runs" / "ref" / "overrides.txt").read_text().split()
        assert "model.name=reference-checkpoint" in overrides
        return
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "args.profile" in lines[0], out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_profile_name_with_dots_and_plus_composes(tmp_path):
    ckpt = _reference_checkpoint(_trmoe_model())
    ckpt["args"]["profile"] = "100m_o200k.v2+tr-b"
    assert _convert(tmp_path, ckpt).returncode == 0
    overrides = (tmp_path / "runs" / "ref" / "overrides.txt").read_text().split()
    assert to_config(compose_config(*overrides)).model.name == "reference-100m_o200k.v2+tr-b"


# The old runner's training loop, written from the fact sheet (4.1 per step, 4.7 AdamW groups, 4.8 schedules):
# the runner itself is not in this environment. Its parameter names map onto trmoe's by the converter's table.
RUNNER_EXPERT = ("ffn.routed.w_in", "ffn.routed.w_out")  # .mlp.gate_proj_w / up_proj_w / down_proj_w
RUNNER_SHARED = ("ffn.shared.w_in", "ffn.shared.w_out", "ffn.shared_gate")  # .mlp.shared_*


def _runner_loop(model: TRMoETransformer, batches, steps: int, lr: float = 3e-4) -> list[float]:
    """The runner's steps on `model`: six AdamW groups (betas 0.9/0.95, eps 1e-8, decay 0.1 on ndim >= 2
    without bias/norm, the tied embedding included, the routed gate in "base"), LambdaLR from lambda(0) = 0,
    warmup max(1, int(0.05 T)), cosine to a 10% floor, p's cosine ramp over R = max(1, int(0.5 T)) steps
    (R <= 1: the final value), no clipping. Returns each step's mean cross-entropy."""
    groups: dict[tuple[str, bool], list] = {}
    for name, param in model.named_parameters():
        kind = (
            "expert" if name.endswith(RUNNER_EXPERT) else "shared" if name.endswith(RUNNER_SHARED) else "base"
        )
        decay = param.ndim >= 2 and "norm" not in name and "bias" not in name
        groups.setdefault((kind, decay), []).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": ps, "weight_decay": 0.1 if decay else 0.0} for (_, decay), ps in groups.items()],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=True,
    )
    warmup = max(1, int(0.05 * steps))

    def lr_lambda(s: int) -> float:
        if s < warmup:
            return s / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    ramp = max(1, int(steps * 0.5))
    losses = []
    for s in range(1, steps + 1):
        p = 0.85 if ramp <= 1 else 0.5 + 0.35 * (0.5 - 0.5 * math.cos(math.pi * min(1.0, (s - 1) / ramp)))
        for block in model.blocks:
            block.ffn.routed.primary_weight = p
        inputs, targets = batches(s)
        optimizer.zero_grad(set_to_none=True)
        logits = model.logits(model(inputs))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.subprocess
@pytest.mark.parametrize("steps", [20, 23])  # 23: int and round give other ramps (p over 11 vs 12 steps)
@pytest.mark.parametrize(
    ("strategy", "runner_name"),
    [("modulo_cyclic", "modulo_cyclic"), ("balanced_secondary", "modulo_balanced_secondary")],
)
def test_the_preset_trains_as_the_runners_own_loop(tmp_path, strategy, runner_name, steps):
    """A converted old-runner checkpoint trained T AdamW steps by trmoe with compat=old_runner and the
    converter's overrides only, against the runner's loop (above) from the same weights on the same batches:
    every step's loss within 1e-5 and the final weights within 1e-5 (fp32)."""
    import csv

    from trmoe.data.build import build_data
    from trmoe.data.pipeline import micro_batch_samples

    model = _trmoe_model(strategy)
    ckpt = _reference_checkpoint(model, routing_strategy=runner_name)
    ckpt["step"], ckpt["args"]["steps"] = 0, steps  # weights to start a run of T steps from
    assert _convert(tmp_path, ckpt).returncode == 0
    run_dir = tmp_path / "runs" / "ref"
    overrides = (run_dir / "overrides.txt").read_text().split()
    settings = [
        "data=random",
        "hardware=cpu",
        "hardware.threads=1",
        "trainer.seq_len=16",
        "trainer.grad_accum=1",
    ]
    settings += ["trainer.micro_batch=2", f"trainer.steps={steps}", "trainer.log_every=1", "run.name=ft"]
    settings += ["trainer.eval_every=0", "checkpoint.keep_last=1"]
    out = cli(["compat=old_runner", *overrides, *settings, f"trainer.init_from={run_dir}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    with (tmp_path / "runs" / "ft" / "metrics.csv").open() as f:
        trmoe_losses = [float(r["train_loss"]) for r in csv.DictReader(f) if int(r["step"]) >= 1]

    cfg = to_config(compose_config("compat=old_runner", *overrides, *settings))
    data = build_data(cfg, V)

    def batches(step: int):
        ((first, count),) = micro_batch_samples(step, 0, 1, 2, 1)
        return data.train.batch(first, count)

    runner = TRMoETransformer(model_spec(cfg))
    runner.load_state_dict(load_checkpoint(run_dir)["model"])
    runner_losses = _runner_loop(runner, batches, steps)
    assert len(trmoe_losses) == steps
    worst = max(abs(a - b) for a, b in zip(trmoe_losses, runner_losses, strict=True))
    print(f"{strategy} T={steps}: largest per-step loss difference {worst:.2e}")
    assert worst <= 1e-5, (trmoe_losses, runner_losses)
    final = load_checkpoint(tmp_path / "runs" / "ft")["model"]
    for name, param in runner.state_dict().items():
        torch.testing.assert_close(final[name], param, rtol=0, atol=1e-5, msg=name)
