"""Reading a package's imports from its source with `ast` (no import runs), and finding a cycle in the
graph they make: the structure tests of sglang_ext/scheduler and router/ use it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def imported_names(path: Path, package: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in the file at `path` (a module of `package`, e.g.
    `router.api`), anywhere in it: under `if TYPE_CHECKING:` and inside functions too. `from a.b import c`
    gives both `a.b` and `a.b.c` (c may be a module or a name in one); relative imports are resolved."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # `from .x import y` / `from .. import x`
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts) + (f".{node.module}" if node.module else "")
            else:
                base = node.module or ""
            yield node.lineno, base
            for a in node.names:
                yield node.lineno, f"{base}.{a.name}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (its nodes in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*path[path.index(d):], d]
            if d not in state and (c := visit(d)) is not None:
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)) is not None:
            return c
    return None
