"""Layering (design §1): registry/ is the domain and imports no edge; actors/ imports no edge.

Every import statement counts, including ones inside functions and `if TYPE_CHECKING:` blocks,
because each still ties the inner layer to the outer one.
"""

from __future__ import annotations

import ast
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
