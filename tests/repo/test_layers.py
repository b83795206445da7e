"""client/ and server/ in floors: a folder imports only the floors below it, never one beside or above.

Each folder is one stage of the data path (docs/architecture.md, "Layout"); a module directly in client/ or
server/ is its own unit. The import graph is read with `ast` from every import in the sources, lazy and
TYPE_CHECKING ones included, so a circle cannot hide in a function body. FLOORS is the table, written out:
the top floor first.
"""

from __future__ import annotations

import ast
import graphlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FLOORS: dict[str, list[set[str]]] = {
    "client": [
        {"cli"},  # the command line: info, groups, push, verify, serve, the demo
        {"__init__"},  # the public face: what `from weightsync.client import ...` gives
        {"sdk"},  # WeightSyncClient
        {"parts"},  # one version from many trainer ranks
        {"push"},  # one push and its runs
        {"servers"},  # what the SDK knows of each server
        {"transports"},  # where a bucket's bytes go
        {"buckets"},  # tensors into buckets
        {"channels", "delta"},  # gRPC to the servers; what changed since the last commit
        {"errors", "types", "intra_op"},  # leaf types
    ],
    "server": [
        {"cli"},
        {"app"},  # the process: gRPC server, health, metrics, signals
        {"rpc"},  # the gRPC edge, no node state
        {"node"},  # one node: what every RPC acts on
        {"update"},  # one update, Begin to Committed
        {"intake", "engines"},  # what a stream may say; what reads the store from outside
        {"workers", "groups", "published", "credentials"},
        {"store", "parts", "tasks", "metrics", "config"},
    ],
}
"""Top floor first; a unit imports units of the floors below its own only."""

ACROSS = {("client", "cli"): {("server", "cli")}}
"""Imports from one package into the other: `weightsync serve` runs the server's command line."""

MOST_DIRECTLY_IN = 12
"""At most this many modules directly in client/ or server/ (the rest live in their stage's folder)."""


def unit_of(package: str, parts: list[str]) -> str:
    """The unit a module (its dotted parts below the package) belongs to: its folder, or itself."""
    if not parts:
        return "__init__"
    return parts[0]


def imports(path: Path) -> set[tuple[str, tuple[str, ...]]]:
    """(package, parts below it) of each weightsync.client/server module or name a source imports."""
    found: set[tuple[str, tuple[str, ...]]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[list[str]] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module.split(".")
            if len(module) == 2:  # from weightsync.client import X: a module, or a name of the package
                names = [module + [alias.name] for alias in node.names]
            else:
                names = [module]
        elif isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        for name in names:
            if name[0] == "weightsync" and len(name) > 1 and name[1] in FLOORS:
                found.add((name[1], tuple(name[2:])))
    return found


def is_module(root: Path, package: str, parts: list[str]) -> bool:
    base = root / package / Path(*parts) if parts else root / package
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def edges(root: Path = ROOT) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    """(package, unit) -> (package, unit) of every import between two units of the sources under root."""
    out = set()
    for package in FLOORS:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root / package).with_suffix("").parts)
            source = (package, unit_of(package, parts if parts != ["__init__"] else []))
            for target_package, target_tuple in imports(path):
                target_parts = list(target_tuple)
                if target_parts and not is_module(root, target_package, target_parts):
                    target_parts = []  # a name of the package itself (its __init__)
                target = (target_package, unit_of(target_package, target_parts[:1]))
                if target != source:
                    out.add((source, target))
    return out


def floor_of(package: str, unit: str) -> int:
    for number, floor in enumerate(FLOORS[package]):
        if unit in floor:
            return number
    raise AssertionError(f"{package}/{unit} is on no floor: add it to FLOORS in tests/repo/test_layers.py")


def test_every_unit_is_on_a_floor():
    for package in FLOORS:
        units = {unit_of(package, list(p.relative_to(ROOT / package).with_suffix("").parts[:1]))
                 for p in (ROOT / package).rglob("*.py")}
        if not imports(ROOT / package / "__init__.py"):
            units.discard("__init__")  # a package docstring only (server/)
        for unit in units:
            floor_of(package, unit)


def test_no_import_runs_up_or_sideways():
    wrong = []
    for (source_package, source), (target_package, target) in sorted(edges()):
        if source_package != target_package:
            if (target_package, target) not in ACROSS.get((source_package, source), set()):
                wrong.append(f"{source_package}/{source} imports {target_package}/{target} (not in ACROSS)")
        elif floor_of(target_package, target) <= floor_of(source_package, source):
            wrong.append(f"{source_package}/{source} imports {target_package}/{target}, on its floor or above")
    assert wrong == []


def test_the_floors_are_what_the_imports_need():
    """Each floor is used: a table that allows more than the code does hides the next upward import less."""
    used = {(package, unit) for (package, unit), _ in edges()} | {target for _, target in edges()}
    listed = {(package, unit) for package, floors in FLOORS.items() for floor in floors for unit in floor}
    assert listed - used == set()


def test_no_circle_inside_a_folder():
    """Inside one folder too the modules import each other one way (the update's steps see the session
    through a Protocol, server/update/view.py, instead of importing it)."""
    for package in FLOORS:
        for folder in [ROOT / package, *(p.parent for p in (ROOT / package).glob("*/__init__.py"))]:
            prefix = tuple(folder.relative_to(ROOT / package).parts)
            graph = {path.stem: {parts[len(prefix)] for target, parts in imports(path)
                                 if target == package and parts[:len(prefix)] == prefix and len(parts) > len(prefix)
                                 and (folder / f"{parts[len(prefix)]}.py").is_file()} - {path.stem}
                     for path in folder.glob("*.py")}
            list(graphlib.TopologicalSorter(graph).static_order())  # CycleError names the circle


def test_a_few_modules_directly_in_client_and_server():
    for package in FLOORS:
        direct = sorted(p.name for p in (ROOT / package).glob("*.py"))
        assert len(direct) <= MOST_DIRECTLY_IN, direct


def test_every_folder_is_a_listed_package():
    """A folder under client/ or server/ that pyproject.toml does not list is left out of the wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for package in FLOORS:
        for init in (ROOT / package).rglob("__init__.py"):
            folder = init.parent.relative_to(ROOT / package).parts
            assert ".".join(("weightsync", package, *folder)) in listed, init


def test_the_graph_sees_an_upward_import(tmp_path):
    """The check itself: an import from client/buckets/ up into client/push/ is reported."""
    fake = tmp_path / "client"
    (fake / "buckets").mkdir(parents=True)
    (fake / "push").mkdir()
    for folder in (fake / "buckets", fake / "push"):
        (folder / "__init__.py").write_text("")
    (fake / "push" / "run.py").write_text("")
    (fake / "buckets" / "packing.py").write_text("from weightsync.client.push.run import PushRun\n")
    (fake / "buckets" / "planning.py").write_text("def later():\n    from weightsync.client import push\n")
    assert edges(tmp_path) == {(("client", "buckets"), ("client", "push"))}
    assert floor_of("client", "push") < floor_of("client", "buckets")
