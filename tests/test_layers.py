"""The import structure written in ``resilienced/__init__.py`` holds.

Every ``import`` of every module of ``resilienced/``, ``handlers/`` and ``trainer/`` is read with
``ast`` (module level and inside functions alike, so a lazy import counts), and checked against:

1. the numbered layers of the ``resilienced`` docstring (nothing imports upward; every module
   is in a layer and every name there is a module, so the list cannot go stale);
2. nothing outside ``resilienced/local/`` imports ``resilienced.local`` or names it in a string
   (``importlib.import_module("resilienced.local...")``);
3. ``trainer/`` imports nothing of ``resilienced`` or ``handlers``, and the daemon imports of
   ``trainer/`` only ``trainer.manifest`` and ``trainer.resume`` (the formats both sides read;
   standard library only);
4. nothing outside ``trainer/integrations/`` imports it (the framework callbacks, whose
   libraries are optional extras);
5. no import cycles.

And the daemon's modules (all but ``resilienced.local``) import only what pyproject.toml's base
dependencies install, which is what the daemon image has.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import resilienced

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("resilienced", "handlers", "trainer")
LOCAL = "resilienced.local"


def module_files() -> dict[str, Path]:
    """dotted module name -> file, for every module of the three packages."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = module_files()


def resolve(name: str) -> str | None:
    """The module that ``name`` (a module, or a name inside one) is in; None: not ours."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module of ours) for each import in the file (relative imports resolved)."""
    module = next(m for m, p in MODULES.items() if p == path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = resolve(target)
            if resolved is not None and resolved != module:
                found.append((node.lineno, resolved))
    return found


EDGES: dict[str, list[tuple[int, str]]] = {m: imports_of(p) for m, p in MODULES.items()}


def documented_layers(doc: str) -> list[list[str]]:
    """The module names of each numbered line ``N. a, b, c: what they are`` of ``doc``."""
    layers: list[list[str]] = []
    for number, names in re.findall(r"^(\d+)\. ([^:\n]+):", doc, flags=re.M):
        assert int(number) == len(layers) + 1, f"layer {number} is out of order"
        layers.append([n.strip() for n in names.split(",")])
    return layers


LAYERS = documented_layers(resilienced.__doc__ or "")


def full_name(name: str) -> str:
    return name if name in ("resilienced", "handlers") else f"resilienced.{name}"


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The layer of the longest name covering ``module`` (``resilienced`` covers only itself)."""
    best: tuple[int, int] | None = None
    for index, names in enumerate(layers):
        for name in map(full_name, names):
            covers = module == name or (name != "resilienced" and module.startswith(name + "."))
            if covers and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def upward_imports(edges: dict[str, list[tuple[int, str]]], layers: list[list[str]]) -> list[str]:
    problems = []
    for module, targets in edges.items():
        if module.startswith("trainer"):
            continue
        here = layer_of(module, layers)
        for line, target in targets:
            there = layer_of(target, layers)
            if here is not None and there is not None and there < here:
                problems.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} (layer {here + 1}) "
                                f"imports {target} (layer {there + 1})")
    return problems


def local_references(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Imports of ``resilienced.local`` outside it, and strings naming its modules (not docstrings)."""
    problems = []
    for module, targets in edges.items():
        if module == LOCAL or module.startswith(LOCAL + "."):
            continue
        path = MODULES[module]
        problems += [f"{path.relative_to(ROOT)}:{line}: imports {target}"
                     for line, target in targets if target == LOCAL or target.startswith(LOCAL + ".")]
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        problems += [f"{path.relative_to(ROOT)}:{n.lineno}: names {n.value!r}" for n in ast.walk(tree)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)
                     and n.value.startswith(LOCAL) and id(n) not in docstrings]
    return problems


def trainer_imports(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    return [f"{MODULES[m].relative_to(ROOT)}:{line}: imports {t}" for m, targets in edges.items()
            if m.startswith("trainer") for line, t in targets if not t.startswith("trainer")]


#: The modules of ``trainer/`` the daemon may import: the formats both sides read from S3 (the
#: checkpoint manifest; the resume record of an attempt that trained its first step).
SHARED_FORMATS = ("trainer.manifest", "trainer.resume")


def daemon_imports_of_trainer(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    return [f"{MODULES[m].relative_to(ROOT)}:{line}: imports {t}" for m, targets in edges.items()
            if not m.startswith("trainer") for line, t in targets
            if t.startswith("trainer") and t not in SHARED_FORMATS]


INTEGRATIONS = "trainer.integrations"


def integration_imports(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Imports of ``trainer.integrations`` (transformers, lightning) from outside it: a script
    that uses neither callback must not import them, nor need those libraries."""
    return [f"{MODULES[m].relative_to(ROOT)}:{line}: imports {t}" for m, targets in edges.items()
            if not m.startswith(INTEGRATIONS) for line, t in targets if t.startswith(INTEGRATIONS)]


def cycles(edges: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    graph = {m: sorted({t for _, t in targets}) for m, targets in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, []):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_docstring_lists_layers_and_every_name_there_is_a_module() -> None:
    assert len(LAYERS) >= 4, "resilienced/__init__.py lists no layers"
    missing = [name for names in LAYERS for name in names if full_name(name) not in MODULES]
    assert not missing, f"layers name modules that do not exist: {missing}"


def test_every_module_is_in_a_layer() -> None:
    unplaced = [m for m in MODULES if not m.startswith("trainer") and layer_of(m, LAYERS) is None]
    assert not unplaced, f"add these to the layers of resilienced/__init__.py: {unplaced}"


def test_nothing_imports_from_a_layer_above() -> None:
    assert upward_imports(EDGES, LAYERS) == []


def test_nothing_outside_local_imports_local() -> None:
    assert local_references(EDGES) == []


def test_trainer_imports_nothing_of_the_daemon() -> None:
    assert trainer_imports(EDGES) == []


def test_the_daemon_imports_of_trainer_only_the_shared_formats() -> None:
    """The daemon image has no torch: of ``trainer/`` it reads only the formats' one definitions,
    which import nothing but the standard library."""
    assert daemon_imports_of_trainer(EDGES) == []
    for shared in SHARED_FORMATS:
        assert EDGES.get(shared) == [] and third_party_imports([shared]) == {}, shared


def test_nothing_outside_the_integrations_imports_them() -> None:
    assert integration_imports(EDGES) == []


def test_there_are_no_import_cycles() -> None:
    assert cycles(EDGES) == []


# --------------------------------------------------------------------------- the checks can fail
@pytest.mark.parametrize("edge, check", [
    (("resilienced.model", "resilienced.daemon"), "layers"),
    (("resilienced.daemon", "resilienced.local.drill"), "local"),
    (("resilienced.cli", "resilienced.local"), "local"),
    (("trainer.loop", "resilienced.model"), "trainer"),
    (("resilienced.recovery.durable", "trainer.checkpoint"), "daemon-trainer"),
    (("trainer.resilience", "trainer.integrations.transformers"), "integrations"),
    (("resilienced.ports", "resilienced.consumer"), "cycle"),
])
def test_each_check_finds_a_forbidden_import(edge: tuple[str, str], check: str) -> None:
    source, target = edge
    edges = {m: list(t) for m, t in EDGES.items()}
    edges[source].append((0, target))
    if check == "layers":
        assert any(f"imports {target}" in p for p in upward_imports(edges, LAYERS))
    elif check == "local":
        assert any(f"imports {target}" in p for p in local_references(edges))
    elif check == "trainer":
        assert any(f"imports {target}" in p for p in trainer_imports(edges))
    elif check == "daemon-trainer":
        assert any(f"imports {target}" in p for p in daemon_imports_of_trainer(edges))
    elif check == "integrations":
        assert any(f"imports {target}" in p for p in integration_imports(edges))
    else:
        assert any(source in c and target in c for c in cycles(edges))


# --------------------------------------------------------------------------- what the daemon image needs
def third_party_imports(modules: list[str]) -> dict[str, str]:
    """top-level name -> first place, for every import of ``modules`` that is neither ours nor stdlib."""
    found: dict[str, str] = {}
    for module in modules:
        path = MODULES[module]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in (n.split(".")[0] for n in names):
                if name not in sys.stdlib_module_names and name not in PACKAGES and name != "__future__":
                    found.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def base_distributions() -> set[str]:
    """pyproject.toml's base dependencies and everything they require (no extras): the daemon image."""
    todo = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(requirement.name) or []:
            nested = Requirement(line)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                todo.append(nested)
    return seen


def test_the_daemon_outside_local_needs_only_the_base_dependencies() -> None:
    """What the daemon image installs (no "test" or "train" extra: no moto, no torch) is enough for
    every module but ``resilienced.local``; local/'s own needs are not the image's."""
    daemon = [m for m in MODULES if m.split(".")[0] in ("resilienced", "handlers")
              and not (m == LOCAL or m.startswith(LOCAL + "."))] + list(SHARED_FORMATS)
    providers = metadata.packages_distributions()
    base = base_distributions()
    missing = {name: where for name, where in third_party_imports(daemon).items()
               if not any(canonicalize_name(d) in base for d in providers.get(name, []))}
    assert missing == {}
