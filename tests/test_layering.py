"""Package layering: no import circle, ``errors.py`` at the bottom, ``train/`` does not
import ``sim/``, one MoE layer reads in four files, the emulator (``sim/``) runs the
exchange's stage sequence rather than its own, the runtime (``parallel/``) knows the
:class:`~lrmoe.policy.plan.Plan` type, never a policy, and docs/design.md's module map
(§1) names every module of the package and only those."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

import lrmoe

SRC = Path(lrmoe.__file__).parent


def _imports(pkg: str) -> list[tuple[str, str]]:
    """``(file, module)`` for every import in ``lrmoe/<pkg>/``, at any depth of the code."""
    out = []
    for f in sorted((SRC / pkg).glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out += [(f.name, node.module)] + [(f.name, f"{node.module}.{a.name}")
                                                  for a in node.names]
            elif isinstance(node, ast.Import):
                out += [(f.name, a.name) for a in node.names]
    return out


def _module_names() -> dict[str, Path]:
    """``lrmoe.a.b`` -> its file, for every module and package of the source tree."""
    out = {}
    for f in SRC.rglob("*.py"):
        parts = ("lrmoe",) + f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the lrmoe modules it imports, at module level or inside a function
    (``from lrmoe.a import b`` counts as ``lrmoe.a.b`` where that is a module, else as
    ``lrmoe.a``); relative imports resolved."""
    files = _module_names()
    graph = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_cycles_finds_a_circle_and_only_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_sees_function_level_and_relative_imports():
    g = import_graph()
    assert "lrmoe.units" in g["lrmoe.ledger"]  # module level
    assert "lrmoe.policy.registry" in g["lrmoe.sim.ttl"]  # inside a function
    assert "lrmoe.model.moe" in g["lrmoe.model"]  # ``from lrmoe.model.moe import``


# Circles still to break. The list may only shrink (it is empty: none is allowed).
REMAINING: list[list[str]] = []


def test_no_import_circle():
    new = [c for c in cycles(import_graph()) if c not in REMAINING]
    assert new == [], new


# Functions still to split into named steps. The list may only shrink.
LONG_REMAINING: set[str] = set()


def test_no_function_over_80_lines():
    long = set()
    for f in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > 80:
                long.add(f"{f.relative_to(SRC).as_posix()}:{node.name}")
    assert long <= LONG_REMAINING, sorted(long - LONG_REMAINING)


def test_errors_imports_nothing_of_lrmoe():
    assert import_graph()["lrmoe.errors"] == set()


def test_train_does_not_import_sim():
    bad = [(f, m) for f, m in _imports("train") if m == "lrmoe.sim" or m.startswith("lrmoe.sim.")]
    assert not bad, bad


def test_parallel_imports_only_the_plan_type():
    bad = [(f, m) for f, m in _imports("parallel")
           if m.startswith("lrmoe.policy") and not m.startswith("lrmoe.policy.plan")]
    assert not bad, bad


# the stages that move a layer's rows: only the exchange's stage sequence
# (lrmoe.parallel.exchange.forward_ranks / backward_ranks) calls them
ROW_STAGES = {"dispatch_rows", "experts_forward", "combine", "home_backward",
              "experts_backward", "router_grad_experts", "home_finish"}


def _stage_uses(tree: ast.AST) -> set[str]:
    """The row stages ``tree`` names: ``stages.<name>`` or imported from the stages module."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "stages":
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("parallel.stages"):
            used |= {a.name for a in node.names}
    return used & ROW_STAGES


def _parsed(f: Path) -> ast.Module:
    return ast.parse(f.read_text())


def test_emulator_runs_the_exchange_stage_sequence_not_its_own():
    """The emulator composes the runtime's stage sequence over its virtual ranks; it never
    calls the stages one by one (a second copy of the sequence to keep in step)."""
    bad = {f.name: sorted(_stage_uses(_parsed(f))) for f in (SRC / "sim").glob("*.py")
           if _stage_uses(_parsed(f))}
    assert not bad, bad
    assert _stage_uses(_parsed(SRC / "parallel" / "exchange.py")) == ROW_STAGES


def test_one_process_path_runs_the_exchange_stage_sequence_not_its_own():
    """The one-process path is the exchange over one rank with no collectives; it never
    calls the row stages itself."""
    tree = _parsed(SRC / "parallel" / "exchange.py")
    local = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
             and n.name in ("run_local", "OneBlock")]
    assert len(local) == 2
    assert not set().union(*map(_stage_uses, local))


# One MoE layer's forward and backward read in these four files. What else model/moe.py
# reaches by imports is a kernel (``ops/``), the planner (``policy/``), a part of the
# layer that reads on its own (the router, the experts' parameters, the shared MLP) or a
# leaf (records and helpers that import only leaves and kernels).
READ_PATH = {"lrmoe.model.moe", "lrmoe.parallel.instances", "lrmoe.parallel.exchange",
             "lrmoe.parallel.stages"}
OFF_PATH = ("lrmoe.ops.", "lrmoe.policy.")
LAYER_PARTS = {"lrmoe.model.router", "lrmoe.model.experts", "lrmoe.model.layers"}
LEAVES = {"lrmoe.errors", "lrmoe.config", "lrmoe.timing", "lrmoe.traffic",
          "lrmoe.parallel.comm", "lrmoe.parallel.options"}


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` reaches by imports, not following those of ``ops/`` and
    ``policy/`` (what a kernel or the planner imports is not the layer's path)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += [] if m.startswith(OFF_PATH) else sorted(graph[m])
    return seen


def test_reached_stops_at_kernels_and_the_planner():
    g = {"a": {"b", "lrmoe.ops.k"}, "b": {"lrmoe.policy.p"}, "lrmoe.ops.k": {"c"},
         "lrmoe.policy.p": {"d"}, "c": set(), "d": set()}
    assert reached(g, "a") == {"a", "b", "lrmoe.ops.k", "lrmoe.policy.p"}


def test_moe_layer_reads_in_four_files():
    """The lrmoe modules model/moe.py reaches, but kernels, the planner, the layer's parts
    and the leaves, are exactly :data:`READ_PATH`: a fifth file on the path fails here."""
    g = import_graph()
    path = {m for m in reached(g, "lrmoe.model.moe") if not m.startswith(OFF_PATH)}
    assert path - LAYER_PARTS - LEAVES == READ_PATH
    assert len(READ_PATH) <= 4
    # a leaf or a part hides no path: a leaf imports leaves and kernels alone, a part
    # those and the read path
    for m in LEAVES:
        assert {d for d in g[m] if not d.startswith("lrmoe.ops.")} <= LEAVES, m
    for m in LAYER_PARTS:
        assert {d for d in g[m] if not d.startswith("lrmoe.ops.")} <= LEAVES | READ_PATH, m


def test_native_plan_is_static_unbudgeted_plan():
    """The local path's stand-in plan is exactly what the static policy plans."""
    from lrmoe.policy.base import PlanInputs
    from lrmoe.policy.plan import native_plan
    from lrmoe.policy.static import StaticPolicy

    g = torch.Generator().manual_seed(0)
    for G, E in ((1, 8), (2, 8), (4, 8)):
        c = torch.randint(0, 50, (G, E), generator=g)
        want, got = StaticPolicy().plan(c, PlanInputs()), native_plan(c)
        for f in ("inst_expert_GS", "assign_GGS", "retain_GGS", "select_GGS"):
            assert torch.equal(getattr(want, f), getattr(got, f)), (G, E, f)
        assert got.recompute_G is None and got.dropped_GE is None


ROOT = Path(__file__).resolve().parents[1]


def _module_map() -> list[str]:
    """The first-column paths of docs/design.md's module map (§1's package table)."""
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("## 1. Package layout")
    table = text[start:text.index("\nOutside the package:", start)]
    out = []
    for line in table.splitlines():
        if line.startswith("| `"):
            out += re.findall(r"`([^`]+)`", line.split("|")[1])
    return out


def test_module_map_names_every_module_and_only_modules():
    src = ROOT / "src" / "lrmoe"
    tree = {p.relative_to(src).as_posix() for p in src.rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py")}
    named = _module_map()
    assert len(named) == len(set(named)), "a path is named twice in the module map"
    modules = {p for p in named if p.endswith(".py")}
    assert tree - modules == set(), "modules missing from docs/design.md §1's module map"
    assert modules - tree == set(), "docs/design.md §1's module map names modules that do not exist"
    folders = [p for p in named if not p.endswith(".py")]
    assert all(p.endswith("/") and (src / p).is_dir() for p in folders), folders
    assert {p.split("/")[0] + "/" for p in tree if "/" in p} <= set(folders)
