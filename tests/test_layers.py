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
5. no import cycles;
6. every package ``__init__`` is a face: it imports nothing of ours (importing a module runs its
   packages' ``__init__`` first, so one that hands names on drags its siblings, and their
   libraries, into every import of the package; issue #22 counted 29 such edges in 4 of them);
7. importing the bottom layer, ``resilienced.settings``, loads no AWS, Kubernetes or HTTP library
   (read statically here, and seen in a fresh interpreter);
8. one import path per name: a name of the daemon is imported from the module that defines it,
   never from one that only imports it (tests and bench/ included);
9. the root of ``resilienced/`` holds at most 12 modules, and the Folders table of
   docs/architecture.md has a row for every folder that names each of its modules.

And the daemon's modules (all but ``resilienced.local``) import only what pyproject.toml's base
dependencies install, which is what the daemon image has.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
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


def imports_of(path: Path, *, module_level: bool = False) -> list[tuple[int, str]]:
    """(line, module of ours) for each import in the file (relative imports resolved); with
    ``module_level``, only the imports that run when the module is imported."""
    module = next(m for m, p in MODULES.items() if p == path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in (executed_at_import(tree) if module_level else ast.walk(tree)):
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


def executed_at_import(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module is imported: not function bodies, not
    ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If):
            checking = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            todo += node.orelse if checking else node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, (ast.With, ast.ClassDef)):
            todo += node.body
    return found


EDGES: dict[str, list[tuple[int, str]]] = {m: imports_of(p) for m, p in MODULES.items()}
#: The imports that run when each module is imported (no lazy ones inside functions).
IMPORT_TIME_EDGES: dict[str, list[tuple[int, str]]] = {
    m: imports_of(p, module_level=True) for m, p in MODULES.items()}


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


def init_edges(edges: dict[str, list[tuple[int, str]]]) -> dict[str, list[str]]:
    """package -> the modules of ours its ``__init__`` imports (each one an edge every import of
    the package, or of anything in it, pays for)."""
    return {m: sorted({t for _, t in targets}) for m, targets in edges.items()
            if MODULES[m].name == "__init__.py" and targets}


#: What the bottom layer must not load: the AWS, Kubernetes and HTTP client libraries.
HEAVY_LIBRARIES = ("aiobotocore", "aiohttp", "boto3", "botocore", "kubernetes_asyncio")


def loaded_by(module: str, edges: dict[str, list[tuple[int, str]]]) -> tuple[set[str], dict[str, str]]:
    """(our modules, third-party library -> first place) that importing ``module`` runs, following
    the import-time ``edges`` and the ``__init__`` of every package on the way."""
    ours: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        for each in [name, *parents]:
            if each in MODULES and each not in ours:
                ours.add(each)
                todo += [t for _, t in edges.get(each, [])]
    return ours, third_party_imports(sorted(ours), module_level=True)


def bound_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names a module defines, names it only imports) at its top level."""
    defined: set[str] = set()
    imported: set[str] = set()
    for node in executed_at_import(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return defined, imported - defined


def second_import_paths(paths: list[Path]) -> list[str]:
    """``file:line name from module`` for each ``from <daemon module> import name`` where that
    module does not define the name but only imports it: a second import path for one name.
    ``trainer/`` is left out: ``trainer.resilience`` is its public face and hands on the names of
    the user's API on purpose (docs/your-trainer.md)."""
    bound = {m: bound_names(ast.parse(p.read_text())) for m, p in MODULES.items()}
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES
                    and not node.module.startswith("trainer")):
                continue
            only_imported = bound[node.module][1]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {alias.name} from {node.module}"
                      for alias in node.names
                      if f"{node.module}.{alias.name}" not in MODULES and alias.name in only_imported]
    return found


def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    """One import path per name: ``Capacity`` from ``model``, not also from ``capacity.decision``."""
    paths = [*MODULES.values(), *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "bench").rglob("*.py"))]
    assert second_import_paths(paths) == []


#: The most modules the root of ``resilienced/`` may hold (``__init__`` aside): the rest is in a
#: folder per layer (issue #22).
MAX_ROOT_MODULES = 12
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def folder_map(text: str) -> dict[str, set[str]]:
    """folder (``resilienced``, ``resilienced/app``...) -> the backticked names in its row of the
    Folders table of docs/architecture.md."""
    rows = re.findall(r"^\| `(resilienced/[^`]*)`(?: \(root\))? \| (.*) \|$", text, flags=re.M)
    return {folder.rstrip("/"): set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell)) for folder, cell in rows}


def map_gaps(mapped: dict[str, set[str]], root: Path) -> list[str]:
    """What the folder map misses or names wrongly: a package without a row, a row for a folder
    that is gone, a module its row does not name."""
    folders = {p.relative_to(root).as_posix() for p in (root / "resilienced").rglob("*")
               if p.is_dir() and (p / "__init__.py").exists()} | {"resilienced"}
    gaps = [f"{f}: no row" for f in sorted(folders - set(mapped))]
    gaps += [f"{f}: no such folder" for f in sorted(set(mapped) - folders - {"resilienced/samples"})]
    for folder in sorted(folders & set(mapped)):
        modules = {p.stem for p in (root / folder).glob("*.py") if p.stem != "__init__"}
        gaps += [f"{folder}: {m} not named" for m in sorted(modules - mapped[folder])]
    return gaps


def test_the_folder_map_of_the_architecture_page_names_every_folder_and_module() -> None:
    assert map_gaps(folder_map(ARCHITECTURE.read_text()), ROOT) == []


def test_the_folder_map_check_finds_what_is_missing() -> None:
    text = "| `resilienced/` (root) | `model` |\n| `resilienced/gone/` | `x` |\n"
    gaps = map_gaps(folder_map(text), ROOT)
    assert "resilienced/gone: no such folder" in gaps and "resilienced: ports not named" in gaps
    assert "resilienced/app: no row" in gaps


def test_the_root_holds_at_most_twelve_modules() -> None:
    root = sorted(p.stem for p in (ROOT / "resilienced").glob("*.py") if p.stem != "__init__")
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the root of resilienced/: {root}"


def test_package_inits_import_nothing_of_ours() -> None:
    assert init_edges(IMPORT_TIME_EDGES) == {}, "an __init__ hands names on: import them from their module"


def test_importing_settings_loads_no_aws_kubernetes_or_http_library() -> None:
    ours, libraries = loaded_by("resilienced.settings", IMPORT_TIME_EDGES)
    assert {name: where for name, where in libraries.items() if name in HEAVY_LIBRARIES} == {}
    # resilienced.model: the capacity names (model.CAPACITY_NAMES) the settings check; standard library only
    assert ours <= {"resilienced", "resilienced.settings", "resilienced.options", "resilienced.errors",
                    "resilienced.model", "resilienced.capacity", "resilienced.capacity.policy"}, sorted(ours)


@pytest.mark.integration
def test_a_fresh_interpreter_importing_settings_loads_none_of_them() -> None:
    """The same, seen: what ``python -c "import resilienced.settings"`` has in ``sys.modules``."""
    code = ("import json, sys, resilienced.settings; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, cwd=ROOT).stdout)
    assert sorted(set(loaded) & set(HEAVY_LIBRARIES)) == []


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
    (("resilienced.model", "resilienced.app.daemon"), "layers"),
    (("resilienced.app.daemon", "resilienced.local.drill"), "local"),
    (("resilienced.app.cli", "resilienced.local"), "local"),
    (("trainer.loop", "resilienced.model"), "trainer"),
    (("resilienced.recovery.durable", "trainer.checkpoint"), "daemon-trainer"),
    (("trainer.resilience", "trainer.integrations.transformers"), "integrations"),
    (("resilienced.ports", "resilienced.consumer.loop"), "cycle"),
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


def test_the_init_and_settings_checks_find_an_init_that_hands_names_on() -> None:
    """Today's faces import nothing; the ``capacity/__init__`` issue #22 found (it handed on
    ``capacity.ec2``, which imports aiohttp through ``aws.errors``) fails both checks."""
    edges = {m: list(t) for m, t in IMPORT_TIME_EDGES.items()}
    edges["resilienced.capacity"] = [(0, "resilienced.capacity.ec2")]
    assert init_edges(edges) == {"resilienced.capacity": ["resilienced.capacity.ec2"]}
    _, libraries = loaded_by("resilienced.settings", edges)
    assert "aiohttp" in libraries


# --------------------------------------------------------------------------- what the daemon image needs
def third_party_imports(modules: list[str], *, module_level: bool = False) -> dict[str, str]:
    """top-level name -> first place, for every import of ``modules`` that is neither ours nor
    stdlib; with ``module_level``, only those that run when the module is imported."""
    found: dict[str, str] = {}
    for module in modules:
        path = MODULES[module]
        tree = ast.parse(path.read_text())
        for node in (executed_at_import(tree) if module_level else ast.walk(tree)):
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
    # an optional extra of the daemon's own (OPTIONAL_EXTRAS: the plots' matplotlib) is allowed in its
    # one module, imported inside a function only (never when the module is imported)
    for name, module in OPTIONAL_EXTRAS.items():
        if name in missing and missing[name].startswith(MODULES[module].relative_to(ROOT).as_posix()):
            assert name not in third_party_imports([module], module_level=True), f"{module} imports {name} at import"
            assert name not in third_party_imports([m for m in daemon if m != module]), f"{name} outside {module}"
            del missing[name]
    assert missing == {}


#: optional extras of pyproject.toml the daemon's modules may use, each in its one module only, lazily
OPTIONAL_EXTRAS = {"matplotlib": "resilienced.ops.plot"}


def test_the_optional_extras_are_declared_and_pinned() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "matplotlib==" in " ".join(extras["plot"]) and "plot" in (ROOT / "Makefile").read_text()
