"""Render docs/configuration.md from the schema: every option with its type, default and meaning.

    python -m trmoe.tools.configdoc > docs/configuration.md

The comments on the dataclass fields in trmoe/config/schema.py are the text (and, for a section built from
a registry, on its variants' options classes: the optimizers' in trmoe/optim/variants); a test keeps the
page in step with the code.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from pathlib import Path

from trmoe.config import schema
from trmoe.registry import field_comments

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

SECTIONS = [
    ("model", schema.ModelConfig, "Model profile: dimensions of the decoder and its TR-MoE FFN."),
    ("attention", schema.AttentionConfig, "Attention type."),
    ("routing", schema.RoutingConfig, "Route tables or a learned router (see docs/routing.md)."),
    (
        "routing.layers[]",
        schema.LayerRoutingConfig,
        "One entry of `routing.layers`, a per-layer-range strategy (see docs/routing.md): "
        "`routing.layers=[{first: 0, last: 2, strategy: balanced_hash}]`.",
    ),
    (
        "optimizer",
        schema.OptimizerConfig,
        "Optimizer, groups, LR schedule (see docs/optimizers.md). The keys every optimizer shares; each "
        "optimizer's own options (`optimizer.muon_scope`, `optimizer.lion_beta1`, ...) are in "
        "docs/optimizers.md's options table.",
    ),
    (
        "data",
        schema.DataConfig,
        "Training and held-out data. The keys the sources share; each source's own options "
        "(`data.text_path`, `data.hf_dataset`, ...) are in docs/data.md's options table.",
    ),
    ("data.sources.<name>", schema.MixtureSourceConfig, "One source of `data=mixture` (see docs/data.md)."),
    ("hardware", schema.HardwareConfig, "Device and numerics."),
    ("loss", schema.LossConfig, "Training objective."),
    ("tokenizer", schema.TokenizerConfig, "The tokenizer text is read with (see docs/data.md, Tokenizers)."),
    ("trainer", schema.TrainerConfig, "Steps, batch geometry, cadences (top level of conf/config.yaml)."),
    ("run", schema.RunConfig, "Run naming and display (top level of conf/config.yaml)."),
    ("telemetry", schema.TelemetryConfig, "Expert telemetry (see docs/training.md; top level)."),
    (
        "downstream",
        schema.DownstreamConfig,
        "Downstream task accuracy during training (see docs/after_training.md; top level).",
    ),
    ("checkpoint", schema.CheckpointConfig, "Checkpoint cadence and retention (see docs/reliability.md)."),
    ("guard", schema.GuardConfig, "Fault guards: non-finite steps, loss spikes (see docs/reliability.md)."),
    (
        "ladder",
        schema.LadderConfig,
        "A scaling ladder: rungs by one width/depth rule x arms x seeds x token budgets, each budget a "
        "cooldown branch of one stable run (`experiment=ladder`, `ladder_cpu`, `ladder_smoke`; see "
        "docs/scaling.md).",
    ),
    (
        "logger",
        None,
        "Experiment trackers beside metrics.csv (always written): `logger=tensorboard`, several at once with "
        "`logger=[tensorboard,mlflow]`. Each logs metrics.csv's scalars, with `telemetry.moe=true` the "
        "per-layer rows of telemetry.csv (docs/training.md), the resolved config as hyper-parameters and the "
        "run's identity; rank 0 only; a resumed run continues the same tracker run. "
        "The trackers need the `trackers` extra (`pip install 'trmoe[trackers]'`).",
    ),
    (
        "logger.tensorboard",
        schema.TensorBoardLogger,
        "`logger=tensorboard`: TensorBoard event files, in the run directory itself: `tensorboard --logdir "
        "runs` lists each run by its name.",
    ),
    (
        "logger.mlflow",
        schema.MLflowLogger,
        "`logger=mlflow`: MLflow, by default in a local database beside the runs (`runs/mlflow.db`), a new "
        "experiment's artifacts beside it (`runs/mlartifacts`): each run's run_config.json, metrics.csv, "
        "resolved config (config.yaml) and Hydra records (hydra/), logged when the run ends. The `trackers` "
        "extra installs `mlflow-skinny`, MLflow's client, which cannot serve the UI: to browse, `pip install "
        "mlflow` (the full package) and `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`.",
    ),
    ("logger.wandb", schema.WandbLogger, "`logger=wandb`: Weights & Biases (offline by default)."),
    (
        "debug",
        schema.DebugConfig,
        "Debugging aids; the presets also set trainer and checkpoint keys (conf/debug/*.yaml).",
    ),
    (
        "compat",
        None,
        "Another runner's training-step defaults where trmoe's differ: `compat=old_runner` gives the old "
        "runner's optimizer groups (the routed gate in the base group, the tied embedding decayed), no "
        "clipping, its lr, gate init and p and diversity schedules (docs/coming-from-the-old-runner.md).",
    ),
    (
        "hparams_search",
        None,
        "Optuna hyper-parameter searches (hydra-optuna-sweeper, the `search` extra): each preset sets "
        "Hydra's sweeper, its study and the searched keys (conf/hparams_search/*.yaml); every trial is a "
        "training job whose returned value (the final held-out loss) Optuna minimises.",
    ),
]


# The enums of a registry's names are not spelt out here: a new variant (a plug-in's too) changes no line of
# this page; each registry's own table lists its variants.
VARIANT_ENUMS = {
    schema.RoutingStrategy: "a registered strategy (docs/routing.md's table)",
    schema.OptimizerName: "a registered optimizer (docs/optimizers.md's table)",
    schema.DataSource: "a registered source (docs/data.md's table)",
}
VARIANT_OPTIONS = {
    "routing": "one per registered strategy (`routing=multi_hash`: docs/routing.md's table)",
    "optimizer": "one per registered optimizer (`optimizer=lion`: docs/optimizers.md's table)",
    "data": "one per registered source (`data=jsonl`: docs/data.md's table)",
}


def _type_name(tp: object) -> str:
    if tp in VARIANT_ENUMS:
        return VARIANT_ENUMS[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(m.value for m in tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X] and X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    if value is dataclasses.MISSING or value == "???":
        return "(set by the profile)"
    if isinstance(value, enum.Enum):
        value = value.value
    return "null" if value is None else f"`{value}`"


def _options(group: str) -> str:
    if not (CONF_DIR / group).is_dir():
        return ""
    if group in VARIANT_OPTIONS:
        presets = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        listed = ", ".join(f"`{group}={n}`" for n in presets)
        return f"Options: {VARIANT_OPTIONS[group]}; the presets {listed}.\n\n"
    names = schema.group_options(group, plugins=False)
    return "Options: " + ", ".join(f"`{group}={n}`" for n in names) + ".\n\n"


# A section a registry assembles lists its common keys here; each variant's own options are in its axis's
# page (generated from the registry), so a new variant changes no line of this one.
VARIANT_PAGES = {"optimizer": "docs/optimizers.md", "data": "docs/data.md"}


def _common_fields(cls: type, section: str) -> list[dataclasses.Field]:
    if section not in VARIANT_PAGES:
        return list(dataclasses.fields(cls))
    common = {f.name for f in dataclasses.fields(cls.__parts__[0])}
    return [f for f in dataclasses.fields(cls) if f.name in common]


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from `trmoe/config/schema.py` by `python -m trmoe.tools.configdoc`; do not edit by hand.",
        "Every key can be overridden on the command line (`python -m trmoe.train trainer.steps=500`);",
        "a group option is picked with `group=option` (`model=100m`). Cross-field rules are listed in",
        "`trmoe/config/validate.py`; a violation stops the run with one line and exit code 2.",
        "",
    ]
    for name, cls, title in SECTIONS:
        if cls is None:  # a group of options without keys of its own
            out += [f"## `{name}`", "", title, "", _options(name).rstrip("\n"), ""]
            continue
        hints = typing.get_type_hints(cls)
        comments = field_comments(cls)
        out += [f"## `{name}`", "", title, "", _options(name) + "| key | type | default | meaning |"]
        out.append("|---|---|---|---|")
        for f in _common_fields(cls, name):
            meaning = comments.get(f.name, "").replace("|", "\\|")
            out.append(f"| `{name}.{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
