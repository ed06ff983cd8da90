"""The import structure of trmoe (docs/architecture.md): no circle between modules or between packages, the
packages in layers that import only downwards (one upward arrow, named below with its reason), the five
must-never-import rules (each a test below, `test_rule_*`), and CLI error paths that answer before torch is
loaded.

The five rules (docs/architecture.md, "The package layout"):
1. run/ never imports train/ or model/.
2. model/ never imports data/.
3. config/ never loads torch.
4. Nothing but run/ finds a checkpoint: `find_checkpoint` is defined in trmoe/run/ alone, every import of it
   comes from there, and train/ never imports trmoe.load (the model loader of sample, export and eval).
5. Nothing but config/derived.py computes the batch: its functions are defined there alone and every import
   of them comes from there; data/ below the config takes the numbers as arguments.

The static graph is read from the source (every `import`, at module level or inside a function, but not
under `if TYPE_CHECKING:`, which never runs); the import-weight checks run in a fresh interpreter."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trmoe"

# The packages, bottom to top: a package imports only from the layers below its own. A top-level module
# (trmoe/load.py) is a package of its own here; a subpackage (trmoe/train/observe) is part of its package.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("trmoe", "trmoe.errors", "trmoe.durable"),  # the version; the user errors; durable writes
    ("trmoe.registry",),  # the variant registries' one mechanism (built-in modules, plug-ins)
    ("trmoe.cli",),  # the tools' argument parser
    ("trmoe.data",),  # tokenizer, token files, corpora, samplers, the data component, the mixture's blend
    ("trmoe.model",),  # the model and its routing (handed the token-count file by the config: no data/)
    ("trmoe.config",),  # schema, validation against the model's and the data's facts, the ModelSpec, derived
    ("trmoe.runtime", "trmoe.generate", "trmoe.loss"),  # device, ranks, parallel wrapping; decoding; the loss
    ("trmoe.run",),  # the run directory's lifecycle: launch, checkpoints, records, status, lock, signals
    # (trmoe.distill: routing=distilled's parent and counting pass, over run/'s checkpoints and the data)
    ("trmoe.optim", "trmoe.load", "trmoe.report", "trmoe.convert", "trmoe.match", "trmoe.distill"),
    ("trmoe.plan", "trmoe.eval", "trmoe.sample", "trmoe.export"),
    ("trmoe.train",),  # the training job, the Trainer, its observers (train/observe)
    ("trmoe.bench",),  # the benchmarks drive the training step
    ("trmoe.tools",),  # developer tools over everything
)

# The one upward arrow: the data sources' builders read the run's Config (data.*, trainer.*) and live with
# the sources they build; the config layer reads the tokenizer's vocabulary and the token-count file name
# from data/, so the builders cannot sit below it. Only the builders take it: trmoe.data.build and the source
# modules of trmoe.data.sources (an entry names a module or a package of modules), inside their functions.
UPWARD = {("trmoe.data.build", "trmoe.config"), ("trmoe.data.sources", "trmoe.config")}


def _upward(module: str, target_package: str) -> bool:
    return any((module == m or module.startswith(m + ".")) and target_package == p for m, p in UPWARD)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of trmoe: dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module that `import name` loads last: the longest prefix that is a module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str) -> dict[str, int]:
    """The trmoe modules `name` imports (module level and lazy): target -> first line."""
    path, is_package = MODULES[name]
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target and target != name:
            found.setdefault(target, line)

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    walk(other)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "trmoe":
                        add(_owner(alias.name), child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(here[: len(here) - child.level + 1] + ([base] if base else []))
                if base.split(".")[0] != "trmoe":
                    continue
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in MODULES else _owner(base), child.lineno)
            walk(child)

    walk(ast.parse(path.read_text(), str(path)))
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _package(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else name


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of `graph` (node -> what it imports) in import order, or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1][::-1]  # graphlib lists each node before the one that needs it
    return None


def test_no_circle_between_modules():
    cycle = _cycle({name: set(targets) for name, targets in GRAPH.items()})
    assert cycle is None, (
        " -> ".join(f"{a} (line {GRAPH[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False))
        + f" -> {cycle[-1]}"
    )


def _arrows() -> dict[tuple[str, str], list[str]]:
    """Package -> package arrows, each with the module imports that make it."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for name, targets in GRAPH.items():
        for target in targets:
            a, b = _package(name), _package(target)
            if a != b:
                arrows.setdefault((a, b), []).append(f"{name} -> {target}:{targets[target]}")
    return arrows


def test_every_package_has_a_layer():
    layered = [p for layer in LAYERS for p in layer]
    assert len(layered) == len(set(layered))
    assert sorted({_package(n) for n in MODULES}) == sorted(layered)


def test_packages_import_only_downwards():
    """Every package arrow goes to a lower layer, except the one named in UPWARD; so the packages form no
    circle either."""
    layer = {p: i for i, names in enumerate(LAYERS) for p in names}
    wrong = []
    for (a, b), why in sorted(_arrows().items()):
        if layer[b] < layer[a]:
            continue
        allowed = [w for w in why if _upward(w.split(" -> ")[0], b)]
        if allowed != why:
            wrong.append(f"{a} -> {b}: {'; '.join(w for w in why if w not in allowed)}")
    assert not wrong, "\n".join(wrong)
    folders: dict[str, set[str]] = {}
    for a, b in _arrows():
        if not any(a == _package(m) and b == p for m, p in UPWARD):
            folders.setdefault(a, set()).add(b)
    assert _cycle(folders) is None


def test_rule_1_run_imports_neither_train_nor_model():
    """Rule 1: the run lifecycle (trmoe/run/) imports nothing of the model or the training (lazy imports
    too). Below it, the config layer reads the routing strategies' registry (trmoe.model.routing, without
    torch); in a fresh interpreter that imports every run module, that registry is all of model/ there is."""
    run_modules = sorted(n for n in MODULES if _package(n) == "trmoe.run")
    direct = sorted(
        f"{n} -> {t}" for n in run_modules for t in GRAPH[n] if t.startswith(("trmoe.train", "trmoe.model"))
    )
    assert direct == []
    code = (
        "import importlib, sys\n"
        f"for name in {run_modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('trmoe.train', 'trmoe.model'))))\n"
    )
    assert _fresh(code) == "['trmoe.model', 'trmoe.model.routing']"


def _fresh(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()


def test_rule_3_the_config_layer_loads_no_torch():
    """Rule 3: `import trmoe.config.schema` (and every module of trmoe/config, derived.py's batch arithmetic
    included) leaves torch unloaded: the CLIs compose and validate a config before they pay for torch."""
    assert _fresh("import sys, trmoe.config.schema; print('torch' in sys.modules)") == "False"
    assert _fresh("import sys, trmoe.config; print('torch' in sys.modules)") == "False"
    config = sorted(n for n in MODULES if n.startswith("trmoe.config."))
    code = f"import importlib, sys\nfor n in {config!r}: importlib.import_module(n)\n"
    assert _fresh(code + "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))") == "['numpy']"


def test_rule_2_model_imports_no_data():
    """Rule 2: model/ never imports data/ (lazy imports too): the model is handed what it reads (a frequency
    strategy's token-count file is resolved to its path by the config layer, trmoe.config.validate's
    frequencies_path), never a data file name. In a fresh interpreter that imports every model module, no
    data module comes with them."""
    model_modules = sorted(n for n in MODULES if _package(n) == "trmoe.model")
    direct = sorted(f"{n} -> {t}" for n in model_modules for t in GRAPH[n] if _package(t) == "trmoe.data")
    assert direct == []
    code = (
        "import importlib, sys\n"
        f"for name in {model_modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('trmoe.data')))\n"
    )
    assert _fresh(code) == "[]"


def _defined_and_imported(name: str) -> tuple[list[str], list[str]]:
    """The trmoe modules that define a top-level function `name`, and `module:line <- source` for every
    `from source import name` in trmoe and the tests (lazy imports too)."""
    defined, imported = [], []
    files = [(module, path) for module, (path, _) in MODULES.items()]
    files += [(f"tests.{path.stem}", path) for path in sorted((ROOT / "tests").glob("*.py"))]
    for module, path in files:
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body):
            defined.append(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(alias.name == name for alias in node.names):
                imported.append(f"{module}:{node.lineno} <- {'.' * node.level}{node.module or ''}")
    return defined, imported


# Rules 4 and 5: a function that only its home computes -> its home (defined there alone, imported from it).
HOMES = {
    "find_checkpoint": "trmoe.run.find",
    "optimizer_state_bytes": "trmoe.optim.build",
    **dict.fromkeys(
        (
            "micro_batch_tokens",
            "rank_batch_samples",
            "global_batch_samples",
            "global_batch_tokens",
            "eval_windows",
            "eval_tokens",
        ),
        "trmoe.config.derived",
    ),
}


@pytest.mark.parametrize("name", sorted(HOMES))
def test_a_function_lives_in_its_home_alone(name):
    """Rules 4 and 5, name by name: the function is defined in its home module and nowhere else in trmoe
    (no copy of the arithmetic, no second way to find a checkpoint), and whoever imports it by name imports
    it from its home (no re-export)."""
    defined, imported = _defined_and_imported(name)
    assert defined == [HOMES[name]]
    assert [line for line in imported if not line.endswith(f"<- {HOMES[name]}")] == []


def test_rule_4_only_run_finds_a_checkpoint():
    """Rule 4: finding a run's checkpoint is the run directory's business (trmoe/run/find.py): eval/ and
    train/ import `find_checkpoint` from run/, never from trmoe.load, and train/ never imports trmoe.load at
    all (a branch reads its parent's checkpoint through run/, never the loader of sample, export and
    eval)."""
    defined, imported = _defined_and_imported("find_checkpoint")
    assert defined == ["trmoe.run.find"]
    users = {line.split(":")[0] for line in imported}
    assert {"trmoe.load", "trmoe.train.init_from", "trmoe.eval.harness", "trmoe.eval.__main__"} <= users
    assert all(line.endswith("<- trmoe.run.find") for line in imported), imported
    train = sorted(f"{n} -> {t}" for n, ts in GRAPH.items() if _package(n) == "trmoe.train" for t in ts)
    assert [arrow for arrow in train if arrow.endswith("-> trmoe.load")] == []


def test_rule_5_only_config_derived_computes_the_batch():
    """Rule 5: the batch arithmetic (samples and tokens per step, per micro-batch, per evaluation) is
    trmoe/config/derived.py's: the functions above live there alone, the modules that need a batch size
    import them from there, and data/ (below the config) never imports trmoe.config but through
    the builders (data/build.py, data/sources/), the one upward arrow: the rest of data/ takes the numbers
    as arguments
    (pipeline.micro_batch_samples, sampler.eval_batches)."""
    users = {
        n
        for n, targets in GRAPH.items()
        for t in targets
        if t == "trmoe.config.derived" or t.startswith("trmoe.config.derived.")
    }
    assert {"trmoe.data.build", "trmoe.run.identity", "trmoe.train.trainer", "trmoe.plan.build"} <= users
    data = [n for n in MODULES if _package(n) == "trmoe.data"]
    data_to_config = sorted(n for n in data for t in GRAPH[n] if _package(t) == "trmoe.config")
    assert all(_upward(n, "trmoe.config") for n in data_to_config), data_to_config


# what a variant module may import at module level: the config layer reads the variants without torch
VARIANT_IMPORTS = {"trmoe.errors", "trmoe.registry", "trmoe.config.optimizers"}


def _module_level_imports(path: Path) -> set[str]:
    """The top-level package or module names `path` imports at module level (not inside a function)."""
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_variant_modules_import_only_the_config_layer_at_module_level():
    """A variant module (trmoe/optim/variants/*.py) imports at module level only the standard library,
    trmoe.errors, trmoe.registry and trmoe.config.optimizers; torch and the update rules inside its
    functions."""
    wrong = {}
    for path in sorted((PACKAGE / "optim" / "variants").glob("*.py")):
        names = _module_level_imports(path)
        bad = sorted(
            n for n in names if n.split(".")[0] not in sys.stdlib_module_names and n not in VARIANT_IMPORTS
        )
        if bad:
            wrong[path.name] = bad
    assert wrong == {}


_CLI = (
    "import runpy, sys\n"
    "sys.argv = [{module!r}, *{args!r}]\n"
    "try:\n"
    "    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    "except SystemExit as e:\n"
    "    print('exit', e.code, 'torch' in sys.modules)\n"
)


@pytest.mark.parametrize(
    ("module", "args", "key"),
    [
        ("trmoe.train", ["model.hidden_sizee=3"], "hidden_sizee"),
        ("trmoe.train", ["trainer.steps=-1"], "trainer.steps=-1"),
        ("trmoe.plan", ["trainer.steps=-1"], "trainer.steps=-1"),
        ("trmoe.match", ["model.hidden_sizee=3"], "hidden_sizee"),
    ],
)
def test_a_bad_key_is_answered_before_torch_loads(tmp_path, module, args, key):
    """The error path of a bad config: one line naming the key, exit code 2, torch never imported, nothing
    written."""
    proc = subprocess.run(
        [sys.executable, "-c", _CLI.format(module=module, args=args)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.stdout.strip().splitlines()[-1] == "exit 2 False", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


# what a data source module (trmoe/data/sources/*) and the variant declaration may import at module level: the
# config layer reads them, so they load neither torch nor numpy nor the config (a builder imports the rest
# inside its function; the Config type only under TYPE_CHECKING)
SOURCE_MODULE_IMPORTS = ("trmoe.errors", "trmoe.registry", "trmoe.data.variant")


def _module_level_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found.add(node.module or "")
    return found


def test_data_source_modules_import_only_the_standard_library_at_module_level():
    paths = sorted((PACKAGE / "data" / "sources").glob("*.py")) + [PACKAGE / "data" / "variant.py"]
    wrong = []
    for path in paths:
        for name in sorted(_module_level_imports(path)):
            top = name.split(".")[0]
            if (
                top == "trmoe"
                and name not in SOURCE_MODULE_IMPORTS
                or (top != "trmoe" and top not in sys.stdlib_module_names)
            ):
                wrong.append(f"{path.relative_to(ROOT)}: {name}")
    assert not wrong, "\n".join(wrong)
    code = "import sys\nfrom trmoe.data.variant import SOURCES\nSOURCES.names()\n"
    assert _fresh(code + "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))") == "[]"
