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
    # bytes of optimizer state per parameter of the element-wise groups, and per parameter of the matrix
    # groups (with `matrix_groups`): the planner's memory line and the launch-time fits check
    state_bytes: int
    state: str  # that state in words, for the docs table and the planner ("exp_avg, exp_avg_sq")
    options: type | None = None  # a dataclass of its own options (each with a default), or None
    validate: Callable[[Config], None] = _no_rules  # its own rules, raising `fail(...)`'s one line
    matrix_groups: bool = False  # it wants the matrices of optimizer.muon_scope in groups of their own
    matrix_state_bytes: int = 0  # with matrix_groups: bytes of state per matrix-group parameter
    order: int = 100  # built-ins sort by this, then by name


def check_variant(variant: Any) -> None:
    """A valid optimizer declaration (a plug-in's goes through this; its failure is its one line)."""
    if not isinstance(variant, OptimizerVariant):
        raise TypeError(f"expected trmoe.config.optimizers.OptimizerVariant, got {type(variant).__name__}")
    if not variant.name.isidentifier():
        raise ValueError(f"name {variant.name!r} is not an identifier")
    for attr in ("build", "validate"):
        if not callable(getattr(variant, attr)):
            raise TypeError(f"{attr} is not callable")
    for attr in ("state_bytes", "matrix_state_bytes"):
        if not isinstance(getattr(variant, attr), int) or getattr(variant, attr) < 0:
            raise TypeError(f"{attr} must be a whole number of bytes per parameter")
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
        state = f"{v.state_bytes} B: {v.state}"
        if v.matrix_groups:
            state = f"{v.matrix_state_bytes} B on the matrix groups, {v.state_bytes} B on the rest: {v.state}"
        rows.append(f"| `{name}` | {v.doc} | {state} | {options} |")
    return "\n".join(rows) + "\n\n" + options_table(OPTIMIZERS, "optimizer")
