"""The optimizer axis (optimizer.name): what one optimizer declares, and the registry that finds them.

A built-in optimizer is one module of `trmoe.optim.variants` that defines `VARIANT = OptimizerVariant(...)`;
a plug-in is the same object behind an entry point of the group `trmoe.optimizers` (docs/extending.md).
The registry feeds the schema (`OptimizerName`, and `OptimizerConfig`'s keys: the common ones, then each
variant's options, flat as `optimizer.<option>`), validation (`trmoe.config.validate` calls the selected
variant's `validate`), the builder (`trmoe.optim.build`), the planner's memory estimate
(`trmoe.optim.build.optimizer_state_bytes`), docs/configuration.md and docs/optimizers.md's table.

Torch-free, like the whole config layer: a variant module imports torch inside its functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trmoe.errors import UserError
from trmoe.registry import Registry, check_options, options_table

if TYPE_CHECKING:
    from trmoe.config.schema import Config, OptimizerConfig


def fail(option: str, value: object, allowed: str) -> None:
    """The one-line config error of an optimizer option, as trmoe.config.validate words every other:
    `config error: optimizer.<option>=<value>: <what is allowed>`."""
    raise UserError(f"config error: optimizer.{option}={value}: {allowed}")


def _no_rules(cfg: Config) -> None:
    return None


@dataclass(frozen=True)
class OptimizerVariant:
    """Everything trmoe needs to know about one optimizer."""

    name: str  # the value of optimizer.name
    doc: str  # its row in docs/optimizers.md's table: the update rule in a few words
    # build(groups, matrix_groups, cfg, device, seed) -> the optimizer. `groups` are the element-wise
    # parameter groups (trmoe.optim.build.split_param_groups: name, params, lr, base_lr, weight_decay);
    # `matrix_groups` the Muon-style matrix groups, empty unless `matrix_groups` below is set; cfg the
    # optimizer section; device the parameters' device; seed the run's trainer.seed (for any noise).
    # The result must offer param_groups, step, zero_grad, state_dict and load_state_dict.
    build: Callable[[list[dict], list[dict], OptimizerConfig, Any, int], Any]
    # state_bytes(element-wise parameters, matrix-group parameters) -> (bytes of optimizer state, how
    # counted): the planner's memory line (trmoe.plan.memory), e.g. (8 * n, "adamw: 2 fp32 states ...")
    state_bytes: Callable[[int, int], tuple[int, str]]
    options: type | None = None  # a dataclass of its own options (each with a default), or None
    validate: Callable[[Config], None] = _no_rules  # its own rules, raising `fail(...)`'s one line
    matrix_groups: bool = False  # it wants the matrices of optimizer.muon_scope in groups of their own
    state: str = ""  # docs table: its state per parameter, in words ("8 B: exp_avg, exp_avg_sq")
    order: int = 100  # built-ins sort by this, then by name


def check_variant(variant: Any) -> None:
    """A valid optimizer declaration (a plug-in's goes through this; its failure is its one line)."""
    if not isinstance(variant, OptimizerVariant):
        raise TypeError(f"expected trmoe.config.optimizers.OptimizerVariant, got {type(variant).__name__}")
    if not variant.name.isidentifier():
        raise ValueError(f"name {variant.name!r} is not an identifier")
    for attr in ("build", "state_bytes", "validate"):
        if not callable(getattr(variant, attr)):
            raise TypeError(f"{attr} is not callable")
    check_options(variant.options)


OPTIMIZERS: Registry[OptimizerVariant] = Registry(
    "optimizer", group="trmoe.optimizers", package="trmoe.optim.variants", check=check_variant
)


def optimizer_table() -> str:
    """The registry as the markdown tables docs/optimizers.md holds, the optimizers and their options (a test
    keeps the two equal)."""
    rows = [
        "| `optimizer=` | update | state per parameter | options |",
        "|---|---|---|---|",
    ]
    for name, v in OPTIMIZERS.items():
        if OPTIMIZERS.origin(name).plugin:
            continue
        options = ", ".join(f"`{f}`" for f in (v.options.__dataclass_fields__ if v.options else ())) or "-"
        rows.append(f"| `{name}` | {v.doc} | {v.state} | {options} |")
    return "\n".join(rows) + "\n\n" + options_table(OPTIMIZERS, "optimizer")
