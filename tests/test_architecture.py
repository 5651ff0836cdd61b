"""The package's shape: imports only point down, no circles, every file short enough to read.

The import graph is read from the source (every `import` and `from ... import`, inside
functions too, since a lazy import that points up is still an upward dependency), as
`python -m tests.test_architecture` prints it. The floors, bottom to top:

    kernels -> layers -> model -> worker (KV pools, model runner) -> spec, distributed, structured
            -> engine -> llm, eval, quant (offline), bench, viz, server, cli, exercises (the lessons' code
               exercises, which plug a learner's function into any of these; nothing imports them)
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmopt"
MAX_LINES = 400

# A subpackage (or top-level module) may not import any of the ones listed against it.
FORBIDDEN = {
    "kernels": {"layers", "model", "worker", "spec", "distributed", "engine", "server", "bench", "viz", "cli",
                "quant", "llm", "eval", "exercises"},
    "layers": {"model", "worker", "spec", "distributed", "engine", "server", "bench", "viz", "cli", "quant",
               "llm", "eval", "exercises"},
    "model": {"worker", "spec", "distributed", "engine", "server", "bench", "viz", "cli", "quant", "llm", "eval",
              "exercises"},
    "worker": {"spec", "distributed", "engine", "server", "bench", "viz", "cli", "llm", "eval", "exercises"},
    "spec": {"distributed", "engine", "server", "bench", "viz", "cli", "llm", "exercises"},
    "structured": {"worker", "spec", "distributed", "engine", "server", "bench", "viz", "cli", "llm", "eval",
                   "exercises"},
    "distributed": {"engine", "server", "bench", "viz", "cli", "llm", "exercises"},
    "engine": {"server", "bench", "viz", "cli", "llm", "eval", "quant", "exercises"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the llmopt modules it imports (file-level nodes; a package is its __init__)."""
    files = {module_name(f): f for f in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in files.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("llmopt") else None
                if target and target != mod:
                    graph[mod].add(target)
        graph.setdefault(mod, set())
    return graph


def floor(mod: str) -> str:
    """llmopt.engine.scheduler -> engine; llmopt.llm -> llm; llmopt -> llmopt."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floor_graph(graph):
    floors: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            # the package face (llmopt/__init__.py) re-exports from every floor: it is the top
            if floor(a) != floor(b) and floor(a) != "llmopt" and floor(b) != "llmopt":
                floors[floor(a)].add(floor(b))
    return floors


def test_no_import_circles_between_files():
    assert circles(import_graph()) == []


def test_no_import_circles_between_subpackages():
    assert circles(floor_graph(import_graph())) == []


def test_imports_only_point_down():
    upward = sorted(f"{a} imports {b}" for a, targets in import_graph().items() for b in targets
                    if floor(b) in FORBIDDEN.get(floor(a), ()))
    assert upward == []


def test_no_module_calls_another_objects_private_method():
    """A method whose name starts with "_" is its class's own business: called on anything but
    self, cls or super(), it is an edge that leaks (IPython's _repr_*_ display protocol aside)."""
    trees = [(f, ast.parse(f.read_text())) for f in PACKAGE.rglob("*.py")]
    private = {b.name for _, t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef) for b in n.body
               if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and b.name.startswith("_")
               and not b.name.endswith("__") and not b.name.startswith("_repr_")}
    calls = []
    for f, t in trees:
        for n in ast.walk(t):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in private:
                owner = n.func.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) and not (
                        isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super"):
                    calls.append(f"{f.relative_to(ROOT)}:{n.lineno} {ast.unparse(n.func)}")
    assert calls == []


def test_every_file_is_short_enough_to_read():
    sources = [f for pattern in ("*.py", "*.cpp", "*.h") for f in PACKAGE.rglob(pattern)]  # the C++ kernels too
    long = {str(f.relative_to(ROOT)): n for f in sources if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}


if __name__ == "__main__":
    g = import_graph()
    print("file circles:", circles(g))
    print("floor circles:", circles(floor_graph(g)))
    for a, targets in sorted(floor_graph(g).items()):
        print(f"{a:12s} -> {', '.join(sorted(targets))}")
