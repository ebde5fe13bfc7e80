"""The scheduler package's shape, read from its source with ast: its modules import each other without
a cycle (imports under `if TYPE_CHECKING:` and inside functions count), so members see the loop only
through the view defined below them (`view.py`), never through `Scheduler`."""

from __future__ import annotations

import ast
from pathlib import Path

from _import_graph import find_cycle, imported_names

PKG = Path(__file__).resolve().parent.parent / "sglang_ext" / "scheduler"
PREFIX = "sglang_ext.scheduler."


def scheduler_imports() -> dict[str, set[str]]:
    """Module (file stem) -> the modules of sglang_ext/scheduler it imports, anywhere in its source."""
    mods = {p.stem for p in PKG.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for path in PKG.glob("*.py"):
        for _, name in imported_names(path, PREFIX.rstrip(".")):
            if name.startswith(PREFIX):
                stem = name[len(PREFIX):].split(".")[0]
                if stem in mods and stem != path.stem:
                    graph[path.stem].add(stem)
    return graph


def test_the_cycle_finder_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_scheduler_modules_import_no_cycle() -> None:
    graph = scheduler_imports()
    assert graph.get("scheduler"), "the package was not read"
    assert find_cycle(graph) is None


def test_members_see_the_view_not_the_scheduler() -> None:
    graph = scheduler_imports()
    users = {m for m, deps in graph.items() if "scheduler" in deps}
    assert users == set()
    assert "view" in graph["rotary"] and "view" in graph["remote_residency"] and "view" in graph["handoff"]


def _code(name: str) -> str:
    """A module's source without its comments and docstrings (what runs)."""
    tree = ast.parse((PKG / name).read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_the_loop_asks_its_members_and_never_tests_a_home() -> None:
    """No KV-home or rotation branch in the loop: a residency member answers for its home."""
    for name in ("scheduler.py", "overlap.py"):
        code = _code(name)
        assert "KVHome." not in code, name
        # nor on the rotation setting: the rotation member installs itself and picks the pool's allocator
        for wrong in ("rot is None", "rot is not None", "self.rot.", "s.rot.", ".home is", ".home ==", ".home !=",
                      "preemption_mode", "HoldingAllocator"):
            assert wrong not in code, (name, wrong)


def test_the_scheduler_file_stays_small() -> None:
    assert len((PKG / "scheduler.py").read_text().splitlines()) <= 400
