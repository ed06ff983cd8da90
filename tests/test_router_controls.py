"""The router controls of Fan et al. 2024 (docs/routing.md): `frozen_router` (a learned router's W_r at its
init, never trained) and `rerandomised_router` (a fresh W_r every optimizer step, from (seed, layer, step)).
Their defining properties, their parameter counts, and bit-exact SIGKILL resume of a run with each."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, compose_config, killed_and_resumed
from presets import RANDOM_IDS_CPU

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.model.moe import TRMoEFFN
from trmoe.model.routing import draw_router, router_step_seed
from trmoe.model.spec import ffn_spec
from trmoe.model.transformer import TRMoETransformer, parameter_counts
from trmoe.run.checkpoint import load_checkpoint
from trmoe.runtime.env import seed_everything

RUN = [*RANDOM_IDS_CPU, "trainer.micro_batch=2", "trainer.steps=8", "trainer.log_every=1"]
RUN += ["checkpoint.every_steps=4", "telemetry.moe=true", "run.name=r"]
SEED = 42  # trainer.seed of the runs (the default)


def _spec(strategy: str):
    return model_spec(to_config(compose_config("model=tiny", "model.vocab_size=512", f"routing={strategy}")))


def test_frozen_router_is_the_learned_init_uncounted_and_rerandomised_has_no_parameter():
    """Under one seed the frozen router is drawn exactly as the learned one (same place in the init order);
    it takes no gradient, and parameter counts leave it out as they leave out route tables."""
    models = {}
    for strategy in ("learned", "frozen_router", "rerandomised_router", "modulo_cyclic"):
        torch.manual_seed(0)
        models[strategy] = TRMoETransformer(_spec(strategy))
    learned, frozen = models["learned"].state_dict(), models["frozen_router"].state_dict()
    assert learned.keys() == frozen.keys()
    for key in learned:
        assert torch.equal(learned[key], frozen[key]), key
    router = models["frozen_router"].blocks[0].ffn.router
    assert not router.requires_grad
    ids = torch.randint(0, 512, (2, 16))
    models["frozen_router"](ids).square().mean().backward()
    assert router.grad is None
    counts = {s: parameter_counts(_spec(s)) for s in models}
    spec = _spec("learned")
    assert counts["frozen_router"] == counts["rerandomised_router"] == counts["modulo_cyclic"]
    assert counts["learned"].total - counts["frozen_router"].total == spec.num_layers * spec.num_experts * 64
    assert not any(n.endswith("router") for n, _ in models["rerandomised_router"].named_parameters())


def test_rerandomised_routes_differ_across_steps_and_are_a_pure_function_of_seed_layer_step():
    spec = ffn_spec(num_experts=8, top_k=2, routed_width=32, strategy="rerandomised_router", route_seed=7)
    spec = replace(spec, num_layers=2, shared_scales=(1.0, 1.0), routed_scales=(1.0, 1.0))
    x, ids = torch.randn(64, spec.hidden_size), torch.zeros(64, dtype=torch.long)

    def routes(layer: int, step: int) -> torch.Tensor:
        ffn = TRMoEFFN(spec, layer)
        ffn.redraw_router(step)
        with torch.no_grad():
            ffn(x, ids)
        return ffn.routed.routes(ids)

    first = routes(0, 3)
    assert torch.equal(first, routes(0, 3))  # a fresh module: the same draw
    for other in (routes(0, 4), routes(1, 3)):  # another step, another layer
        assert (other != first).float().mean() > 0.3
    assert router_step_seed(7, 0, 3) != router_step_seed(7, 0, 4) != router_step_seed(7, 1, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Per strategy: an uninterrupted 8-step run, and a run SIGKILLed in step 6's forward then resumed from
    its step-4 checkpoint (the killed attempt in a forked child, the rest in this process)."""
    root = tmp_path_factory.mktemp("router_controls")
    return killed_and_resumed(
        root, {s: [*RUN, f"routing={s}"] for s in ("frozen_router", "rerandomised_router")}
    )


@pytest.mark.subprocess
@pytest.mark.parametrize("strategy", ["frozen_router", "rerandomised_router"])
def test_sigkill_resume_is_bit_exact(runs, strategy):
    assert_same_run(runs[strategy + "/resumed"], runs[strategy])


@pytest.mark.subprocess
def test_frozen_router_keeps_its_init_through_training_and_no_optimizer_holds_it(runs):
    seed_everything(SEED)  # what the trainer does before it builds the model
    init = TRMoETransformer(model_spec(to_config(compose_config(*RUN, "routing=frozen_router")))).state_dict()
    final = load_checkpoint(runs["frozen_router"])["model"]
    routers = [k for k in final if k.endswith("ffn.router")]
    assert len(routers) == 2
    for key in routers:
        assert torch.equal(final[key], init[key]), key
    assert not torch.equal(final["blocks.0.ffn.routed.w_in"], init["blocks.0.ffn.routed.w_in"])  # it trained
    record = json.loads((runs["frozen_router"] / "run_config.json").read_text())
    held = sum(g["params"] for g in record["controls"]["optimizer_groups"])
    assert held == parameter_counts(_spec("frozen_router")).total


@pytest.mark.subprocess
def test_rerandomised_router_of_the_last_step_is_its_draw(runs):
    checkpoint = load_checkpoint(runs["rerandomised_router"])
    step, model = checkpoint["step"], checkpoint["model"]
    for layer in (0, 1):
        w = model[f"blocks.{layer}.ffn.router_draw"]
        assert torch.equal(w, draw_router(0, layer, step, *w.shape, 0.02))
        assert not torch.equal(w, draw_router(0, layer, step - 1, *w.shape, 0.02))
