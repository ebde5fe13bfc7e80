"""The router package's shape, read from its source with ast: its folders import each other without a
cycle (imports under `if TYPE_CHECKING:` and inside functions count).

A node of the graph is a folder of router/ (`api`, `placement`, `placement/planning`, ...: all its
modules together) or one module directly in router/ (`config.py`, `core.py`, ...: the root holds the
composition and the small modules shared below the folders, so each is a node of its own). Types two
folders share live in a module below both (router/errors.py, router/limit_spec.py); the readiness probe
reaches placements only through `PlacementStrategy` (router/placement/base.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

from _import_graph import find_cycle, imported_names

ROUTER = Path(__file__).resolve().parent.parent / "router"


def _node(rel: Path) -> str:
    """The graph node of a module at `rel` (relative to router/): its folder, or itself at the root."""
    return rel.parent.as_posix() if len(rel.parts) > 1 else rel.name


def _module_path(name: str) -> Path | None:
    """The file (relative to router/) of the longest prefix of dotted `name` that is a router module or
    package; None: not the router's (or only the `router` package itself)."""
    parts = name.split(".")
    if parts[0] != "router":
        return None
    for n in range(len(parts), 1, -1):
        rel = Path(*parts[1:n])
        if (ROUTER / rel).with_suffix(".py").is_file():
            return rel.with_suffix(".py")
        if (ROUTER / rel / "__init__.py").is_file():
            return rel / "__init__.py"
    return None


def router_edges() -> dict[tuple[str, str], list[str]]:
    """(node, node it imports) -> where (`file:line -> name`), for every import between two nodes."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROUTER.rglob("*.py")):
        rel = path.relative_to(ROUTER)
        package = ".".join(("router", *rel.parent.parts))
        for line, name in imported_names(path, package):
            target = _module_path(name)
            if target is None:
                continue
            a, b = _node(rel), _node(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{rel}:{line} -> {name}")
    return edges


def router_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in router_edges():
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    return graph


def test_nodes_are_folders_and_root_modules() -> None:
    assert _node(Path("api/app.py")) == "api"
    assert _node(Path("placement/planning/base.py")) == "placement/planning"
    assert _node(Path("config.py")) == "config.py"
    assert _module_path("router.config.RouterConfig") == Path("config.py")
    assert _module_path("router.api.common.ApiError") == Path("api/common.py")
    assert _module_path("router.placement.planning") == Path("placement/planning/__init__.py")
    assert _module_path("router") is None and _module_path("sglang_ext.messages") is None


def test_router_folders_import_no_cycle() -> None:
    graph = router_graph()
    edges = router_edges()
    # the graph was read: the core uses placement and resilience, the HTTP API uses the core
    assert {"placement", "resilience"} <= graph["core.py"] and "core.py" in graph["api"]
    cycle = find_cycle(graph)
    where = [f"{a} -> {b}: {edges[a, b][0]}" for a, b in itertools.pairwise(cycle)] if cycle else []
    assert cycle is None, where


def test_the_shared_types_sit_below_the_folders_that_share_them() -> None:
    """The two cycles this replaced: resilience <-> api (ApiError), resilience <-> config (LimitSpec)."""
    graph = router_graph()
    assert "api" not in graph["resilience"] and "resilience" not in graph["config.py"]
    assert "errors.py" in graph["resilience"] and "errors.py" in graph["api"]
    assert "limit_spec.py" in graph["config.py"] and "limit_spec.py" in graph["resilience"]



def test_readiness_sees_placements_only_through_their_interface() -> None:
    names = [w for (a, b), where in router_edges().items() if a == "readiness.py" and b == "placement"
             for w in where]
    assert all(" -> router.placement.base" in w for w in names), names
