"""From a composed Hydra config to validated, typed objects the components consume."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator
from importlib.resources import files

from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from trmoe.config.ladder import apply_rung, write_back
from trmoe.config.param_match import apply_match, ignore_solved_width
from trmoe.config.schema import Config
from trmoe.config.tokenizer import resolve_tokenizer
from trmoe.config.validate import validate, validate_ladder
from trmoe.errors import UserError


def compose_error(e: BaseException) -> str:
    """One line from a Hydra composition error (unknown key, bad value, missing group option, bad syntax)."""
    import yaml
    from hydra.errors import MissingConfigException, OverrideParseException

    for cause in _chain(e):  # a UserError raised while composing (run.name in hydra.run.dir) says it all
        if isinstance(cause, UserError):
            return str(cause)
        if isinstance(cause, yaml.MarkedYAMLError) and cause.problem_mark is not None:  # a broken YAML file
            mark = cause.problem_mark
            return (
                f"config error: {mark.name}: line {mark.line + 1}, column {mark.column + 1}: not valid YAML "
                f"({cause.problem})"
            )
        if isinstance(cause, yaml.YAMLError):
            return f"config error: not valid YAML ({str(cause).strip().splitlines()[0]})"
    for cause in _chain(e):  # an override of a key the schema lacks (a UserError above outranks it)
        known = _fields(getattr(cause, "object_type", None))
        if isinstance(cause, ConfigAttributeError | ConfigKeyError) and known and str(cause.key) not in known:
            return unknown_key(cause.full_key, known)
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    head = lines[0] if lines else type(e).__name__
    mistaken = _misread(head, e)
    if mistaken:
        return f"config error: {mistaken}"
    if isinstance(e, MissingConfigException):  # a group option that does not exist
        # Hydra lists no options for a group of groups (arm=<grid>/<arm>): the tree's folders then
        options = [o for o in e.options or [] if not o.startswith("base_")]
        options = options or group_options(e.missing_cfg_file)
        return f"config error: {head}" + (f"; allowed: {', '.join(options)}" if options else "")
    if isinstance(e, OverrideParseException):  # the grammar's message does not say which override
        return f"config error: {e.override}: {head}"
    cause = e.__cause__
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    if not detail and len(lines) > 1 and not lines[1].startswith(("To append", "See ")):
        detail = lines[1]
    return f"config error: {head}" + (f" ({detail})" if detail and detail not in head else "")


def _misread(head: str, e: BaseException) -> str | None:
    """What the user meant where Hydra's words point elsewhere: a sweep value without --multirun ("Ambiguous
    value ... use it as a list"), `+group=` for a group the defaults list has ("Multiple values ... use
    'override'"), an override without its `=` ("Error parsing override")."""
    import re

    from hydra.errors import OverrideParseException

    ambiguous = re.match(r"Ambiguous value for argument '(.+?)'", head)
    if ambiguous:
        line = ambiguous.group(1)
        key, _, value = line.partition("=")
        as_list = "" if group_options(key.lstrip("+~")) else f" (or {key}=[{value}] for one list value)"
        return f"{line}: a comma-separated value is a sweep; add --multirun to sweep it{as_list}"
    twice = re.match(r"Multiple values for (\S+?)\. To override a value use 'override \1: (.+)'", head)
    if twice:
        group, value = twice.groups()
        return (
            f"+{group}={value}: {group} is a group the config already has (the + adds a new one); "
            f"drop the +: {group}={value}"
        )
    if isinstance(e, OverrideParseException) and "=" not in e.override and not e.override.startswith("~"):
        return missing_equals(e.override)
    return None


def missing_equals(override: str, following: str | None = None) -> str:
    """The line for a command-line word that is no override: `key value` instead of `key=value`."""
    fix = f"{override}={following}" if following is not None else f"{override}=<value>"
    return f"{override}: an override needs its '=' (no spaces around it); write {fix}"


def unknown_key(key: str, known: list[str]) -> str:
    """The one line for a key the schema does not have: its section, the closest name, every allowed one."""
    section = key.rpartition(".")[0] or "the config"
    close = difflib.get_close_matches(key.rpartition(".")[2], known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    allowed = ", ".join(known)
    return f"config error: {key}: {section} has no such key; {hint}allowed: {allowed} (docs/configuration.md)"


def _fields(cls: object) -> list[str]:
    """The field names of a schema dataclass (what a section takes), or [] for anything else."""
    return (
        [f.name for f in dataclasses.fields(cls)]
        if isinstance(cls, type) and dataclasses.is_dataclass(cls)
        else []
    )


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    """The exception and those it was raised from or while handling (OmegaConf wraps a resolver's error)."""
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def group_options(path: str) -> list[str]:
    """What a group takes at the deepest existing folder of `path` (a group, or a missing option such as
    'arm/topk/nosuch') in the packaged config tree, written as the group's value: its options (`topk/dense`)
    and its nested groups (`topk/...`), which Hydra's own error does not list."""
    parts = path.split("/")
    folder = files("trmoe.conf")
    depth = 0
    while depth < len(parts) and (folder / parts[depth]).is_dir():
        folder, depth = folder / parts[depth], depth + 1
    if depth == 0:
        return []
    prefix = "".join(f"{part}/" for part in parts[1:depth])
    return sorted(
        f"{prefix}{entry.name}/..." if entry.is_dir() else f"{prefix}{entry.name.removesuffix('.yaml')}"
        for entry in folder.iterdir()
        if (entry.is_dir() and not entry.name.startswith("_")) or entry.name.endswith(".yaml")
    )


MULTI_OPTION_GROUPS = ("logger",)  # groups whose options add up (each sets its own key)


def check_group_overrides(overrides: list[str]) -> None:
    """A config group takes one option name. Hydra merges a list of them into one config (`model=[tiny,50m]`
    trains a merged model) and refuses any other value (`=5`) with a traceback: a UserError naming the
    override and the group's options instead. A sweep (`model=tiny,50m`) is checked job by job. Overrides
    that do not parse raise Hydra's OverrideParseException (see compose_error)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(list(overrides)):
        group, value = override.key_or_group, override.value()
        deletion = override.is_delete() and value is None  # `~model`
        if override.is_sweep_override() or isinstance(value, str | dict) or deletion:
            continue  # an option, a sweep, a dict merged into the group's node
        if not group:
            raise UserError(
                f"config error: {override.input_line}: names no key; allowed: <key>=<value>, <group>=<option>"
            )
        if group in MULTI_OPTION_GROUPS and isinstance(value, list):
            continue  # several trackers at once: logger=[tensorboard,mlflow]
        options = group_options(group) if "/" not in group else []  # the top-level groups of the tree
        if options:
            raise UserError(
                f"config error: {override.input_line}: the {group} group takes one option; "
                f"allowed: {', '.join(options)}"
            )


def compose_packaged(overrides: list[str], *, hydra_node: bool = False) -> DictConfig:
    """The packaged config with these overrides, composed as the train app composes it (one option per
    group first), with the hydra node when asked (hydra.launcher sizes the world); writes nothing. Every
    composition error is a one-line UserError (compose_error): the tools' shared entrance."""
    from hydra import compose, initialize_config_module

    import trmoe.config.schema  # noqa: F401  (registers the schemas)

    try:
        check_group_overrides(list(overrides))
        with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
            return compose("config", overrides=list(overrides), return_hydra_config=hydra_node)
    except UserError:
        raise
    except Exception as e:  # Hydra's and OmegaConf's errors, and the ValueError of a group it cannot take
        raise UserError(compose_error(e)) from None


def _unknown_keys(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, list[str]]]:
    """(dotted key, the keys its section has) for each key the schema does not define: Hydra's `+key=value`
    adds one even to a structured config, and converting to the dataclasses would silently drop it."""
    schema = OmegaConf.get_type(node)
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        if known is not None and key not in known:
            yield f"{prefix}{key}", known
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            yield from _unknown_keys(child, f"{prefix}{key}.")


def to_config(cfg: DictConfig) -> Config:
    """Resolve interpolations, convert to the dataclass tree, run the cross-field checks and solve the
    parameter match (model.match_params), writing the solved width back into cfg as well."""
    for key, known in _unknown_keys(cfg):
        raise UserError(unknown_key(key, known))
    try:
        config = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise UserError(
            f"config error: {e.full_key} is required but not set ({e.full_key}=<value>)"
        ) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise UserError(f"config error: {key}: {str(e).splitlines()[0]}") from None
    if not isinstance(config, Config):
        raise UserError("config error: the primary config does not extend base_config")
    # tokenizer=bpe: its file, sha256 and vocabulary, recorded in the saved config and run_config.json
    settled = resolve_tokenizer(config)
    if settled:
        with read_write(cfg), open_dict(cfg):
            for key, value in settled.items():
                OmegaConf.update(cfg, key, value, force_add=True)
    # A ladder's rung (ladder.*) sets the model's shape and match target: checked, applied, written back.
    validate_ladder(config)
    write_back(cfg, apply_rung(config))
    # Parameter matching (model.match_params): validate the other fields, solve the width, check the result
    # by the same rules, and write it back into cfg too, so that the saved config and run_config.json show
    # the width that is trained.
    ignore_solved_width(config)
    validate(config)
    match = apply_match(config)
    if match is not None:
        validate(config)
        with read_write(cfg), open_dict(cfg):
            cfg.model[match.field] = match.width
    return config
