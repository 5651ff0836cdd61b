"""The package's shape: imports only point down, no circles, every file short enough to read,
and docs/structure.md (the map of the code) true.

The import graph is read from the source (every `import` and `from ... import`, inside
functions too, since a lazy import that points up is still an upward dependency), as
`python -m tests.test_architecture` prints it. The floors, bottom to top, are the map's:

    data -> kernels -> layers -> model -> worker (KV pools, model runner)
         -> techniques (spec, structured, distributed) -> engine
         -> top (llm, eval, quant, bench, viz, server, cli, exercises: the lessons' code exercises,
            which plug a learner's function into any of these; nothing imports them)

A technique's folder may hold a piece a lower floor calls (the samplers that verify drafts);
the map names each such file with its own floor.
"""

from __future__ import annotations

import ast
import gc
import re
import sys
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmopt"
MAP = ROOT / "docs" / "structure.md"
MAX_LINES = 400
FLOORS = ["data", "kernels", "layers", "model", "worker", "techniques", "engine", "top"]


def _table(title: str) -> list[list[str]]:
    """The rows of the first markdown table after the line starting with `title`."""
    lines = MAP.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[at:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # without the header and its rule


def _paths(cell: str) -> list[str]:
    return re.findall(r"`(llmopt/[^`]*)`", cell)


@cache
def the_map() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(folder or module -> floor, file -> its own floor, technique -> home folder), from docs/structure.md."""
    places = {p: row[0] for row in _table("| floor | folders and modules") for p in _paths(row[1])}
    own = {p: row[1] for row in _table("| file | floor") for p in _paths(row[0])}
    homes = {row[0]: _paths(row[1])[0] for row in _table("| technique | home")}
    return places, own, homes


def floor(mod: str) -> str:
    """llmopt.engine.scheduler -> engine; llmopt.spec.tree_sampler -> layers (the map says so);
    llmopt -> llmopt (the package face, which re-exports from every floor: it is above the top)."""
    parts = mod.split(".")
    if len(parts) == 1:
        return "llmopt"
    places, own, _ = the_map()
    file = "/".join(parts) + ".py"
    if file in own:
        return own[file]
    if f"llmopt/{parts[1]}.py" in places:
        return places[f"llmopt/{parts[1]}.py"]
    return places.get(f"llmopt/{parts[1]}/", "unmapped")


def place(mod: str) -> str:
    """The folder or top-level module a module lives in: llmopt.spec.tree -> spec."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


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
    """Which floors import which (the package face aside)."""
    floors: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            if floor(a) != floor(b) and "llmopt" not in (floor(a), floor(b)):
                floors[floor(a)].add(floor(b))
    return floors


def test_no_import_circles_between_files():
    assert circles(import_graph()) == []


def test_no_import_circles_between_floors():
    assert circles(floor_graph(import_graph())) == []


def test_imports_only_point_down():
    """A module imports its own floor and those below; the techniques (speculative decoding,
    structured outputs, parallelism) do not import one another; nothing imports the exercises."""
    rank = {f: i for i, f in enumerate(FLOORS)}
    wrong = []
    for a, targets in import_graph().items():
        for b in targets:
            fa, fb = floor(a), floor(b)
            if "llmopt" in (fa, fb):
                continue
            if (rank[fb] > rank[fa] or (fa == fb == "techniques" and place(a) != place(b))
                    or (place(b) == "exercises" and place(a) != "exercises")):
                wrong.append(f"{a} ({fa}) imports {b} ({fb})")
    assert sorted(wrong) == []


def test_the_map_names_every_folder_and_module_and_nothing_else():
    places, own, homes = the_map()
    here = {f"llmopt/{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    here |= {f"llmopt/{p.name}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert set(places) == here
    assert set(places.values()) <= set(FLOORS) and set(own.values()) <= set(FLOORS)
    named = re.findall(r"`(llmopt/[^`]*)`", MAP.read_text())
    assert [p for p in named if not (ROOT / p).exists()] == []
    assert all(home.endswith("/") and (ROOT / home).is_dir() for home in homes.values())


# A technique's code is in its home: outside it (and outside the kernels, which hold every kernel,
# and the top floor's views, benchmarks and exercises), no function or class is named for it.
TECHNIQUE_NAMES = {
    "speculative decoding": r"propos|rejection|draft|eagle|ngram|layer_skip|tree_sampl|spec_step",
    "structured outputs": r"grammar|bitmask|jump_forward|structured",
    "tensor and pipeline parallelism": r"tensor_parallel|pipeline|micro_batch|all_reduce|all_gather",
}
# Where another floor calls a technique, or holds a request's share of its state: named, with why.
HOOKS = {
    "llmopt/engine/llm_engine.py:_propose": "the engine asks the proposer for drafts before scheduling",
    "llmopt/engine/llm_engine.py:_grammar_bitmask": "the engine asks the grammars for the step's bitmask",
    "llmopt/engine/llm_engine.py:_pipelined_step": "the engine keeps a pipeline's micro-batches in flight",
    "llmopt/sequence.py:clear_drafts": "a request's drafts are part of its state",
    "llmopt/structured/matcher.py:fill_with_drafts": "a grammar masks the rows of a request's drafts too",
}


def test_every_technique_lives_in_its_home():
    _, _, homes = the_map()
    stray = []
    for f in PACKAGE.rglob("*.py"):
        mod = module_name(f)
        if floor(mod) in ("kernels", "top", "llmopt"):
            continue
        rel = str(f.relative_to(ROOT))
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            for technique, pattern in TECHNIQUE_NAMES.items():
                if (re.search(pattern, node.name.lower()) and not rel.startswith(homes[technique])
                        and f"{rel}:{node.name}" not in HOOKS):
                    stray.append(f"{rel}: {node.name} ({technique}, home {homes[technique]})")
    assert sorted(stray) == []


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


# -- at run time: no object of a higher floor handed to a lower one ------------------------------------
# The import rules above cannot see an engine handing itself (or its block manager, scheduler,
# structured-output manager) to a lower floor's function, which then calls back up. So engines
# are built and stepped under sys.setprofile, and every call into an llmopt function is checked:
# no argument (nor an element of a list, tuple or dict argument, nor the object a bound method
# belongs to) may be an instance of a class from a floor above the function's own, unless it is
# one of the callee floor's own kinds: a KV pool (worker) reaches the attention layers as a
# `KVCache`, the interface llmopt/layers/attention.py defines, and attention calls only that.
# The first parameter of a method (self / cls) is the callee's own object and is not checked.
# Plain functions handed down (a lesson's exercise plugged in as `slots_of`) are not objects of
# a floor.
def rank_of_module(module: str) -> int | None:
    """The floor rank of an llmopt module; None for data every floor may receive."""
    f = floor(module)
    return None if f in ("data", "llmopt") else FLOORS.index(f)


TOP = FLOORS.index("top")


@cache
def lowest_rank(cls: type) -> int | None:
    """The lowest floor among the llmopt classes `cls` is (itself and its bases): None when it is
    no llmopt class or one of them is data."""
    ranks = [rank_of_module(c.__module__) for c in cls.__mro__
             if c.__module__ == "llmopt" or c.__module__.startswith("llmopt.")]
    if not ranks or None in ranks:
        return None
    return min(ranks)


def _objects(value, depth: int = 0):
    yield value
    owner = getattr(value, "__self__", None)  # a bound method carries its object up with it
    if owner is not None and not isinstance(value, type):
        yield owner
    if depth == 0 and isinstance(value, (list, tuple)):
        for v in value[:8]:
            yield from _objects(v, 1)
    elif depth == 0 and isinstance(value, dict):
        for v in list(value.values())[:8]:
            yield from _objects(v, 1)


def handoffs(run) -> set[str]:
    """Run `run()` under sys.setprofile; every upward handoff it made, as 'callee(param: Type)'."""
    found: set[str] = set()
    ranks: dict[str, int | None] = {}

    def floor_rank(filename: str):
        if filename not in ranks:
            path = Path(filename)
            ranks[filename] = (rank_of_module(module_name(path)) if PACKAGE in path.parents else None)
        return ranks[filename]

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        here = floor_rank(code.co_filename)
        if here is None or here == TOP:
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        values = frame.f_locals
        for i, name in enumerate(names):
            if i == 0 and name in ("self", "cls"):
                continue
            for obj in _objects(values.get(name)):
                theirs = lowest_rank(type(obj))
                if theirs is not None and theirs > here:
                    found.add(f"{module_name(Path(code.co_filename))}.{code.co_name}"
                              f"({name}: {type(obj).__module__}.{type(obj).__qualname__})")

    import transformers  # noqa: F401 - importing it drops the running profile function: import it first

    sys.setprofile(profile)
    try:
        run()
        kept = sys.getprofile() is profile
    finally:
        sys.setprofile(None)
    assert kept, "something in the run replaced the profile function: the check saw only part of it"
    return found


def _serve_every_path(**engine_args):
    """Build an engine and run requests through the paths it has: plain and sampled decoding,
    a shared prefix, logprobs, min_tokens, a stop string."""
    from llmopt import LLM, SamplingParams

    def run():
        llm = LLM("tiny", max_model_len=256, num_kv_blocks=96, seed=0, **engine_args)
        prefix = "the same opening words, long enough to fill a block or two of the cache: "
        llm.generate([prefix + "one", prefix + "two", "a third prompt"],
                     [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.8, seed=1, logprobs=2),
                      SamplingParams(max_tokens=6, min_tokens=3, stop=["zz"])], use_tqdm=False)
        del llm
    return run


def test_the_handoff_check_sees_an_engine_object_handed_down():
    """The check itself: a block manager (engine) handed to a worker function as itself, in a
    list, or as a bound method, is found; a KV pool handed to attention as its KVCache is not."""
    from llmopt.engine.block_manager import BlockManager
    from llmopt.layers.attention import whole_sequence_attention
    from llmopt.worker.kv_cache import NoKVCache, kv_cache_torch_dtype

    bm = BlockManager(4, 16, True)

    def call(fn, *args):
        def run():
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the call's entry is what is checked
                pass
        return handoffs(run)

    want = {"llmopt.worker.kv_cache.kv_cache_torch_dtype(model_dtype: llmopt.engine.block_manager.BlockManager)"}
    for handed in (bm, [bm], {"bm": bm}, bm.allocate):
        assert call(kv_cache_torch_dtype, "auto", handed) == want
    assert call(kv_cache_torch_dtype, "auto", 5) == set()
    assert call(whole_sequence_attention, None, None, None, None, NoKVCache(), 0, 1.0) == set()


def test_no_object_is_handed_to_a_lower_floor():
    """The default engine, the eager one, the radix cache and an FP8 pool with calibrated scales."""
    found = set()
    for args in ({}, {"enforce_eager": True, "prefix_cache": "radix", "enable_prefix_caching": True},
                 {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}):
        found |= handoffs(_serve_every_path(**args))
    assert sorted(found) == []


def test_no_object_is_handed_to_a_lower_floor_by_speculation_or_grammars():
    """Every proposer (chain and tree), and a constrained request with jump-forward."""
    from llmopt import LLM, SamplingParams
    from llmopt.structured.params import StructuredOutputsParams

    found = set()
    for sc in ({"method": "ngram", "num_speculative_tokens": 3},
               {"method": "draft_model", "num_speculative_tokens": 3},
               {"method": "eagle", "num_speculative_tokens": 3},
               {"method": "eagle", "num_speculative_tokens": 3, "tree": {"top_k": 2, "total_tokens": 8}},
               {"method": "layer_skip", "num_speculative_tokens": 2, "exit_layer": 1}):
        found |= handoffs(_serve_every_path(speculative_config=sc))

    def constrained():
        llm = LLM("tiny", max_model_len=256, num_kv_blocks=64, seed=0)
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}, "required": ["name"]}
        llm.generate(["json: "], SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(
            json=schema)), use_tqdm=False)
        del llm
    found |= handoffs(constrained)
    assert sorted(found) == []



# A step's metadata (which token is whose, where its keys go) is built once per step and passed
# down, model to layer to attention to cache, as an argument: never parked on a shared object
# for a lower layer to read back. After engines have run every path, no llmopt object holds one.
def holders_of_step_metadata() -> set[str]:
    """The llmopt classes whose objects hold an AttentionMetadata as an attribute, right now."""
    from llmopt.layers.attention import AttentionMetadata

    def llmopt_owner(ref) -> str | None:
        kind = type(ref)
        return kind.__qualname__ if any(c.__module__.startswith("llmopt.") for c in kind.__mro__) else None

    gc.collect()
    found = set()
    for meta in (o for o in gc.get_objects() if type(o) is AttentionMetadata):
        for ref in gc.get_referrers(meta):
            if isinstance(ref, dict):  # an attribute dict: whose is it?
                owners = [llmopt_owner(o) for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
            else:                      # an object holding it directly (attributes kept inline)
                owners = [llmopt_owner(ref)]
            found |= {o for o in owners if o and o != "AttentionMetadata"}
    return found


def test_no_step_metadata_is_parked_on_an_object():
    """The compiled and eager engines, and speculation (chain, tree, layer skip), after their
    steps; and the check itself sees a pool that keeps the metadata it was handed."""
    from llmopt import LLM, SamplingParams
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.worker.kv_cache import NoKVCache

    for args in ({}, {"enforce_eager": True},
                 {"speculative_config": {"method": "eagle", "num_speculative_tokens": 3,
                                         "tree": {"top_k": 2, "total_tokens": 8}}},
                 {"speculative_config": {"method": "layer_skip", "num_speculative_tokens": 2, "exit_layer": 1}}):
        llm = LLM("tiny", max_model_len=256, num_kv_blocks=64, seed=0, **args)
        llm.generate(["a prompt", "and another, longer prompt"], SamplingParams(max_tokens=6), use_tqdm=False)
        assert holders_of_step_metadata() == set(), args
        del llm

    class KeepsIt(NoKVCache):
        def begin_step(self, meta):
            self.metadata = meta

    keeps = KeepsIt()
    keeps.begin_step(AttentionMetadata.uncached([3]))
    assert holders_of_step_metadata() == {"test_no_step_metadata_is_parked_on_an_object.<locals>.KeepsIt"}


if __name__ == "__main__":
    g = import_graph()
    print("file circles:", circles(g))
    print("floor circles:", circles(floor_graph(g)))
    for a, targets in sorted(floor_graph(g).items()):
        print(f"{a:12s} -> {', '.join(sorted(targets))}")
