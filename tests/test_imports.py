"""The module import graph of router/ and sglang_ext/, read with ast (imports under `if TYPE_CHECKING:`
and inside functions count as much as the others): sglang_ext's packages import only the layers below
their own, router modules import one another without a cycle, the core reaches placement strategies
only through their interface, and sglang_ext does not import router (only the launcher, which starts
the router, does)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = "sglang_ext.launch"  # `python -m sglang_ext` serves a cluster: it starts the router

# sglang_ext's packages (and top-level modules), lowest first: each imports only from layers below
# its own, never from its own layer's other members or from above. The package's `__init__`
# (`sglang_ext.Engine`, resolved lazily) is the public face on top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("parsers",),  # text only: the OpenAI layer's tool-call and reasoning parsers (server_args checks names)
    ("env", "server_args"),  # settings
    ("configs", "kvcache", "sampling"),  # model configs, KV memory, sampling
    ("ops", "forward_batch", "grammar", "messages", "transport"),  # kernels, a forward's batch, wire
    ("attention", "models"),  # what one forward computes
    ("engine",),  # runs forwards: the model runner, CUDA graphs, the split of local and remote rows
    ("offload", "disagg"),  # remote attention and the prefill/decode hand-off over transport/
    ("scheduler",),  # continuous batching with its members
    ("worker",),  # a process serving one model
    ("entry",),  # the in-process Engine API
    ("launch",),  # the launcher (a router and its workers, or one worker)
    ("__main__", ""),  # `python -m sglang_ext`; "" is sglang_ext/__init__.py
)


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for top in ("router", "sglang_ext"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imported(node: ast.Import | ast.ImportFrom, package: str, mods: dict[str, Path]) -> list[str]:
    """The modules of ours one import statement names (`from a import b`: module a.b if it is one, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*up, base] if base else up)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, anywhere in its source."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node, package, mods):
                while name and name not in mods:  # `import a.b.c` of a name inside a module
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_sees_type_checking_imports() -> None:
    g = cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    assert g == [["a", "b"]]
    graph = import_graph()
    # router/tracker.py's WorkerState and RequestState refer to each other: one module, no cycle
    assert "router.tracker" in graph["router.registry"] and "router.registry" not in graph["router.tracker"]


def _layer_of(module: str) -> tuple[int, str]:
    """(layer index, package) of an sglang_ext module."""
    package = module.split(".")[1] if module.count(".") else ""
    for i, names in enumerate(LAYERS):
        if package in names:
            return i, package
    raise AssertionError(f"{module}: package {package!r} is in no layer of LAYERS")


def test_sglang_ext_packages_import_only_lower_layers() -> None:
    upward = set()
    for mod, deps in import_graph().items():
        if not mod.startswith("sglang_ext"):
            continue
        layer, package = _layer_of(mod)
        for d in deps:
            if d.startswith("sglang_ext"):
                dl, dp = _layer_of(d)
                if dp != package and dl >= layer:
                    upward.add((mod, d))
    assert upward == set()


def test_router_modules_import_no_cycle() -> None:
    graph = import_graph()
    router = {m: {d for d in deps if d.startswith("router")} for m, deps in graph.items() if m.startswith("router")}
    assert cycles(router) == []


def test_the_core_knows_placement_strategies_only_by_their_interface() -> None:
    graph = import_graph()
    placement = {d for d in graph["router.core"] if d.startswith("router.placement")}
    assert placement == {"router.placement.base", "router.placement.strategies"}
    for mod, deps in graph.items():
        if mod.startswith("router.placement"):
            assert "router.core" not in deps, mod


def test_sglang_ext_does_not_import_the_router() -> None:
    graph = import_graph()
    wrong = {(m, d) for m, deps in graph.items() if m.startswith("sglang_ext") and m != LAUNCHER
             for d in deps if d.startswith("router")}
    assert wrong == set()
