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
