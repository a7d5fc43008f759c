"""Layering (design §1): registry/ is the domain and imports no edge; actors/ imports no edge;
and every package imports only the layers below it, in this order: registry, actors, ws, api,
service (the composition root), cli (the command line, the client).

Every import statement counts, including ones inside functions and `if TYPE_CHECKING:` blocks,
because each still ties the inner layer to the outer one.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WEB_FRAMEWORKS = frozenset({"quart", "hypercorn", "quart_trio", "werkzeug"})
REGISTRY_FORBIDDEN = WEB_FRAMEWORKS | {"api", "ws", "actors"}
ACTORS_FORBIDDEN = WEB_FRAMEWORKS | {"api", "ws"}
# I/O libraries: in registry/, only the store adapter (registry/store/) does I/O.
IO_LIBRARIES = frozenset(
    {"httpx", "asyncpg", "trio_asyncio", "trio_websocket", "socket", "ssl", "http", "urllib3"}
)
IO_CALLS = ("trio.socket", "trio.open_tcp_stream", "trio.open_tcp_listeners", "trio.serve_tcp")


LAYERS = ("registry", "actors", "ws", "api", "service", "cli")  # each imports only earlier ones


def imported_modules(source: str, filename: str = "<source>") -> set[str]:
    """Absolute module names imported anywhere in `source` (relative imports stay in-package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def forbidden_imports(package: str, forbidden: frozenset[str]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        modules = imported_modules(path.read_text(encoding="utf-8"), str(path))
        bad = {name for name in modules if name.split(".")[0] in forbidden}
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_packages_under_test_exist() -> None:
    # Guards the tests below against passing vacuously on a moved tree.
    assert (ROOT / "registry" / "canonical.py").is_file()
    assert len(list((ROOT / "registry").rglob("*.py"))) >= 10
    assert list((ROOT / "actors").rglob("*.py"))


def test_registry_imports_no_web_framework_and_no_outer_layer() -> None:
    assert forbidden_imports("registry", REGISTRY_FORBIDDEN) == {}


def io_outside_the_store() -> dict[str, set[str]]:
    """Modules of registry/ (outside registry/store/) that import or call an I/O library."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "registry").rglob("*.py")):
        if (ROOT / "registry" / "store") in path.parents:
            continue
        source = path.read_text(encoding="utf-8")
        bad = {n for n in imported_modules(source, str(path)) if n.split(".")[0] in IO_LIBRARIES}
        bad |= {call for call in IO_CALLS if call in source}
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_registry_does_io_only_in_its_store() -> None:
    assert io_outside_the_store() == {}


def test_the_io_checker_sees_a_client_library_and_trio_sockets(tmp_path: Path) -> None:
    assert {n for n in imported_modules("import httpx") if n in IO_LIBRARIES} == {"httpx"}
    assert {n for n in imported_modules("from asyncpg import connect") if n in IO_LIBRARIES}
    assert any(call in "s = trio.socket.socket()" for call in IO_CALLS)
    assert any(call in "await trio.open_tcp_stream(h, p)" for call in IO_CALLS)


def test_actors_import_neither_api_nor_ws() -> None:
    assert forbidden_imports("actors", ACTORS_FORBIDDEN) == {}


@pytest.mark.parametrize(
    "source",
    [
        "import quart",
        "import hypercorn.trio",
        "from quart_trio import QuartTrio",
        "from werkzeug.exceptions import NotFound",
        "from api.http import Deps",
        "import ws.events as events",
        "from actors import ratelimiter",
        "def later():\n    from api import app\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import actors.supervisor\n",
    ],
)
def test_the_checker_catches_every_form_of_forbidden_import(source: str) -> None:
    modules = imported_modules(source)
    assert {name for name in modules if name.split(".")[0] in REGISTRY_FORBIDDEN}


@pytest.mark.parametrize(
    "source",
    [
        "from . import canonical",
        "from .store import pg",
        "import trio",
        "from registry.errors import Invalid",
        "import apis",
        "import wsproto",
    ],
)
def test_the_checker_allows_inner_and_unrelated_imports(source: str) -> None:
    modules = imported_modules(source)
    assert not {name for name in modules if name.split(".")[0] in REGISTRY_FORBIDDEN}


@pytest.mark.parametrize("layer", LAYERS)
def test_no_package_imports_a_layer_above_it(layer: str) -> None:
    above = frozenset(LAYERS[LAYERS.index(layer) + 1 :])
    assert (ROOT / layer).is_dir()
    assert forbidden_imports(layer, above) == {}


def test_every_package_of_the_checkout_has_a_layer() -> None:
    """A new top-level package must say where it stands."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"tests", "bench"} == set(LAYERS)


def module_graph() -> dict[str, set[str]]:
    """Every module of the layers → the modules of the layers it imports (anywhere in it)."""
    modules: dict[str, Path] = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                found.update(owner(f"{base}.{alias.name}") for alias in node.names)
        graph[name] = {m for m in found if m is not None and m != name}
    return graph


def test_the_modules_import_each_other_without_a_cycle() -> None:
    graph = module_graph()
    assert len(graph) > 80
    assert "registry.store.pg" in graph["service.serve"]
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError, naming the cycle


def test_the_cycle_check_sees_a_cycle() -> None:
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"a": {"b"}, "b": {"c"}, "c": {"a"}}).prepare()
