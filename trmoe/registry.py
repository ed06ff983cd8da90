"""Variant registries: the one mechanism behind every extension axis (optimizers, data sources, route tables).

A *variant* is one object that says everything trmoe needs to know about it (its options dataclass, builder,
validation, docs row, ...); what those fields are is the axis's business (`trmoe.optim.variant`,
`trmoe.data.variant`, `trmoe.model.routing.Strategy`). A registry finds the variants of one axis in two
places, once per process, on first use:

- **built-ins**: every module of one package (`trmoe.optim.variants`, ...) that defines `VARIANT`, found by
  `pkgutil`, so adding a built-in is adding one module. The config layer reads the registries without
  loading torch, so a variant module imports only the standard library and `trmoe.errors`/`trmoe.registry`
  at module level, and everything heavy inside its functions (`tests/test_imports.py` checks it);
- **plug-ins**: the entry points of the axis's group (`trmoe.optimizers`, `trmoe.data_sources`,
  `trmoe.routing`) declared by any installed distribution (docs/extending.md). Each is loaded here; one
  that fails to import, is of the wrong type or clashes with a name already taken is remembered with a
  one-line reason and is an error only for a run that selects it.

Every variant has an `Origin`: built-in, or the plug-in's distribution, version and entry point. A run
records the origin of each variant it selects (run_config.json `plugins`), and a resume refuses when a
plug-in's distribution version changed (`trmoe.run.identity`: the version is training-critical).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Generic, TypeVar

from trmoe.errors import UserError

V = TypeVar("V")


@dataclass(frozen=True)
class Origin:
    """Where a variant comes from: trmoe itself (`dist` None), or a plug-in's distribution."""

    dist: str | None = None  # the distribution that declares the entry point
    version: str | None = None  # its version
    entry_point: str | None = None  # "module:attribute"

    @property
    def plugin(self) -> bool:
        return self.dist is not None

    def record(self) -> dict[str, str | None]:
        """What run_config.json keeps of a selected plug-in."""
        return {"dist": self.dist, "version": self.version, "entry_point": self.entry_point}


class Registry(Generic[V]):
    """The variants of one axis by name: built-ins first (in `order`, then by name), then plug-ins by name.

    `check(variant)` raises TypeError/ValueError with a short reason when an object is not a valid variant of
    the axis (a plug-in's declaration goes through it; a built-in failing it is a bug and raises)."""

    def __init__(
        self,
        axis: str,
        *,
        group: str,
        package: str | None,
        check: Callable[[Any], None],
        extra: Callable[[], dict[str, V]] | None = None,
    ):
        self.axis = axis  # the config key that selects a variant, as users write it: "optimizer"
        self.group = group  # the entry-point group plug-ins declare
        self._package = package
        self._check = check
        self._extra = extra  # built-ins that are not modules of `package` (the route-table constructions)
        self._variants: dict[str, V] | None = None
        self._origins: dict[str, Origin] = {}
        self._broken: dict[str, str] = {}

    # ------------------------------------------------------------------ lookup

    def names(self) -> tuple[str, ...]:
        """Every usable name, built-ins first."""
        return tuple(self._load())

    def __contains__(self, name: object) -> bool:
        return name in self._load()

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def items(self) -> list[tuple[str, V]]:
        return list(self._load().items())

    def get(self, name: str) -> V:
        """The variant called `name`; a UserError (one line, exit 2) naming a broken plug-in and its reason,
        or the allowed names."""
        variants = self._load()
        key = getattr(name, "value", name)
        if key in variants:
            return variants[key]
        if key in self._broken:
            raise UserError(f"{self.axis}={key}: {self._broken[key]}")
        raise UserError(f"{self.axis}={key}: unknown; allowed: {', '.join(variants)}")

    def origin(self, name: str) -> Origin:
        self._load()
        return self._origins.get(getattr(name, "value", name), Origin())

    @property
    def broken(self) -> dict[str, str]:
        """Plug-ins that could not be used: name -> the reason (one line)."""
        self._load()
        return dict(self._broken)

    def exclude(self, name: str, reason: str) -> None:
        """Take a plug-in out (a clash found only once all variants are known): selecting it says `reason`."""
        variants = self._load()
        origin = self._origins.get(name)
        if origin is None or not origin.plugin:
            raise RuntimeError(f"built-in {self.axis} {name!r}: {reason}")
        del variants[name]
        self._broken[name] = f"{self._who(name, origin)} is broken: {reason}"

    def _who(self, name: str, origin: Origin) -> str:
        where = f"{origin.dist} {origin.version}, entry point {origin.entry_point} in {self.group}"
        return f"plug-in {name!r} ({where})"

    # ------------------------------------------------------------------ discovery

    def _load(self) -> dict[str, V]:
        if self._variants is None:
            builtins = dict(self._extra()) if self._extra else {}
            if self._package is not None:
                builtins.update(_builtin_modules(self._package, self._check))
            variants = dict(sorted(builtins.items(), key=lambda kv: (getattr(kv[1], "order", 100), kv[0])))
            for ep in _entry_points(self.group):
                self._add_plugin(variants, ep)
            self._variants = variants
        return self._variants

    def _add_plugin(self, variants: dict[str, V], ep: metadata.EntryPoint) -> None:
        dist = getattr(ep, "dist", None)
        origin = Origin(
            dist=dist.name if dist is not None else "?",
            version=dist.version if dist is not None else "?",
            entry_point=ep.value,
        )
        who = self._who(ep.name, origin)
        if ep.name in variants:
            if self._origins.get(ep.name) == origin:
                return  # the same distribution seen twice on sys.path
            self._broken.setdefault(ep.name, f"{who}: the name is taken by another {self.axis}; rename it")
            return
        try:
            variant = ep.load()
            self._check(variant)
            declared = getattr(variant, "name", ep.name)
            if declared != ep.name:
                raise ValueError(
                    f"it declares the name {declared!r}; the entry point's name must be the same"
                )
        except Exception as e:  # anything a broken plug-in raises: it must not stop runs that do not use it
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self._broken[ep.name] = f"{who} is broken: {type(e).__name__}: {reason}"
            return
        variants[ep.name] = variant
        self._origins[ep.name] = origin


def _builtin_modules(package: str, check: Callable[[Any], None]) -> dict[str, Any]:
    pkg = importlib.import_module(package)
    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        variant = getattr(module, "VARIANT", None)
        if variant is None:
            continue
        check(variant)  # a built-in that fails this is trmoe's bug: let it raise
        found[variant.name] = variant
    return found


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    """The group's entry points, once per (name, value): a distribution found twice on sys.path is one."""
    seen, out = set(), []
    for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
        if (ep.name, ep.value) not in seen:
            seen.add((ep.name, ep.value))
            out.append(ep)
    return out


def check_options(options: Any) -> None:
    """A variant's options: a dataclass (or None: no options) whose fields all have defaults."""
    if options is None:
        return
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TypeError(f"options must be a dataclass, got {options!r}")
    for f in dataclasses.fields(options):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"option {f.name!r} has no default")


def with_options(
    name: str,
    base: type,
    registry: Registry[Any],
    options_of: Callable[[Any], Any],
    order: tuple[str, ...] = (),
    namespace: dict[str, Any] | None = None,
) -> type:
    """The config section of an axis: `base`'s fields (the keys every variant shares), then each variant's
    options (`options_of(variant)`, a dataclass or None) in registry order, flat: `<axis>.<option>`. Options
    keep the names they always had (`optimizer.muon_lr_scale`), so configs and run_config.json files written
    before the registries compose as they did. A plug-in option whose name is already a key is excluded
    (one line when selected); two built-ins clashing is trmoe's bug and raises.

    `order`: keys placed first, in this order (the section's key order before it had variants, so that
    run_config.json and .hydra/config.yaml list them as they did); the others follow as above. The class
    records its parts in `__parts__` (base, then each options class) for the docs' field comments.
    `namespace`: names an options class may use in its annotations without importing them at run time
    (a class of the config layer, which the variant's module sits below)."""
    fields: list[tuple[str, Any, Any]] = [(f.name, hint, f) for f, hint in _typed_fields(base, namespace)]
    taken = {f.name for f in dataclasses.fields(base)}
    parts = [base]
    for variant_name, variant in registry.items():
        options = options_of(variant)
        if options is None:
            continue
        try:
            own = _typed_fields(options, namespace)
            if registry.origin(variant_name).plugin:
                _check_config_types(options)
        except Exception as e:  # options no config can hold: the plug-in's one line, not every run's
            if not registry.origin(variant_name).plugin:
                raise
            reason = (str(e).strip().splitlines() or [""])[0]
            registry.exclude(variant_name, f"its options cannot be config keys: {type(e).__name__}: {reason}")
            continue
        clash = sorted(f.name for f, _ in own if f.name in taken)
        if clash:
            registry.exclude(
                variant_name, f"its option {registry.axis}.{clash[0]} is already a key; rename it"
            )
            continue
        for f, hint in own:
            fields.append((f.name, hint, f))
            taken.add(f.name)
        parts.append(options)
    rank = {key: i for i, key in enumerate(order)}
    fields.sort(key=lambda item: rank.get(item[0], len(rank)))  # stable: the rest keep their order
    specs = []
    for field_name, hint, f in fields:
        default = (
            dataclasses.field(default=f.default)
            if f.default is not dataclasses.MISSING
            else dataclasses.field(default_factory=f.default_factory)
            if f.default_factory is not dataclasses.MISSING
            else dataclasses.field()
        )
        specs.append((field_name, hint, default))
    # flat (no base class): a dataclass cannot move an inherited field, and `order` may have to
    cls = dataclasses.make_dataclass(name, specs)
    cls.__module__ = base.__module__
    cls.__doc__ = base.__doc__
    cls.__parts__ = tuple(parts)
    return cls


def _check_config_types(options: type) -> None:
    """The options class can be a config section (OmegaConf takes every field's type and default)."""
    from omegaconf import OmegaConf

    OmegaConf.structured(options)


def _typed_fields(cls: type, namespace: dict[str, Any] | None = None) -> list[tuple[dataclasses.Field, Any]]:
    """A dataclass's fields with their types resolved (a module with `from __future__ import annotations`
    leaves `Field.type` a string)."""
    hints = typing.get_type_hints(cls, localns=namespace)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def field_comments(cls: type) -> dict[str, str]:
    """{field: the comment after it in the dataclass's source}: a schema's keys are documented there once,
    for docs/configuration.md and for the tools' --help."""
    comments = {}
    # a section a registry assembles (trmoe.registry.with_options: the common keys, then each variant's
    # options) names the classes that declare its fields in __parts__; the first declaration's comment wins
    for source in getattr(cls, "__parts__", (cls,)):
        try:
            lines = inspect.getsource(source).splitlines()
        except (OSError, TypeError):  # no source to read (a class made at run time): no comments
            continue
        for line in lines:
            match = re.match(r"\s+(\w+): [^=]+=.*?(?:#\s*(.*))?$", line)
            if match:
                comments.setdefault(match.group(1), match.group(2) or "")
    return comments


def options_table(registry: Registry[Any], section: str) -> str:
    """The options of trmoe's own variants as a markdown table (`<section>.<option>`, the variant, its
    default and meaning): each axis's docs page holds it, generated (a test keeps the page in step)."""
    rows = [f"| key | `{section}=` | default | meaning |", "|---|---|---|---|"]
    for name, variant in registry.items():
        options = getattr(variant, "options", None)
        if options is None or registry.origin(name).plugin:
            continue
        comments = field_comments(options)
        for f in dataclasses.fields(options):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            shown = "null" if default is None else f"`{getattr(default, 'value', default)}`"
            meaning = comments.get(f.name, "").replace("|", "\\|")
            rows.append(f"| `{section}.{f.name}` | `{name}` | {shown} | {meaning} |")
    return "\n".join(rows) + "\n"
