"""The structure figures issue 26 tracks, measured from the source (``python benchmarks/structure_metrics.py``).

Each figure is counted from the syntax tree, not from text, so comments and strings do not
count. ``--json`` prints them as JSON (tests/unit/test_structure.py reads them as a ratchet).

- facade_lines, facade_constructor_lines, facade_longest_function: ``optim/zero_optimizer.py``;
- functions_taking_opt_any: functions outside the facade whose first parameter is the
  optimizer (named ``opt``/``optimizer``/``zero``) annotated ``Any`` or not annotated;
- private_reads_of_opt: ``opt._x`` attribute reads outside the facade's file;
- import_cycles: strongly connected groups of files that import each other, counting the
  imports inside functions (a lazy import hides a circle, it does not remove it); a package's
  ``__init__`` re-exporting its files is left out;
- offload_kind_compares: comparisons with "nvme"/"cpu"/"auto" outside ``config.py`` (the
  placement policies in ``offload/`` too, since issue 44), not counting a device's type (``x.device.type == "cpu"``);
- any_annotations: annotations that are or contain ``Any``;
- import_cycles_with_annotations (issue 44): the same circles, counting the imports under
  ``if TYPE_CHECKING:`` too (an annotation-only import is still a dependency a reader follows);
- below_facade_naming_facade: modules below the facade (the engine and its policies: every
  folder but the consumers in CONSUMERS) whose code names ``ZeroOptimizer``;
- reads_through_facade: ``opt.<name>`` reads outside the facade of an engine object
  (ENGINE_NAMES, what ``ZeroOptimizer.__getattr__`` used to serve) through a variable that
  holds the optimizer; plus facade_proxy_names, how many names a ``__getattr__`` on the facade serves;
- sibling_folders_both_ways: pairs of top-level folders under zeroshard/ that import each other
  at run time (module level or inside functions), in both directions;
- placement_auto_branches (issue 44): reads of ``.auto``/``.automatic`` and comparisons with
  "auto" in ``offload/`` (the placement is chosen once, by its type, not re-asked per method);
- offload_string_compares (issue 44): comparisons of an offload option or tier with a string
  ("nvme", "cpu", "auto", "host", "device") below ``config.py`` (every module but the config and
  the consumers in CONSUMERS, which read formats of their own), not counting a device's type:
  the config parses the strings once into a ``Tier``.
- mesh_parsers (issue 44): modules that read a DeviceMesh (call ``get_group``, ``get_local_rank``,
  ``get_coordinate`` or ``get_all_groups``, read ``mesh_dim_names``, or take the ``size()`` or
  ``ndim`` of something named ``*mesh*``): the mesh is parsed in one place, comm/mesh.py
  (Note [the mesh variant is the type]).
- gatherer_none_checks (issue 44): a stage asked through the gatherer's presence: ``gatherer is
  None`` / ``is not None`` (a name or an attribute ``gatherer``) and a gatherer used as a truth
  value. The stage's one answer is ``Engine.shards_parameters``; the gatherer itself comes from
  ``Engine.stage3_gatherer`` / ``Sharding.require_gatherer()``, which refuse outside stage 3.
- engine_fields_assigned_after_build (issue 44): assignments to a field of an ``Engine`` (``engine.x =``,
  ``e.x =``, ``opt.engine.x =``) other than its documented state (``closed``, ``ready``): the
  assembly builds the engine complete (Note [assembly]), nothing fills or patches it later;
- duplicate_file_names (issue 44): files under zeroshard/ whose name another file there has too
  (``__init__.py`` and ``__main__.py`` aside): a traceback, an editor tab or a grep names a file
  by its base name, which should say which one.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
from typing import Iterator

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zeroshard")
FACADE = os.path.join("optim", "zero_optimizer.py")
OPT_NAMES = ("opt", "optimizer", "zero")
KINDS = ("nvme", "cpu", "auto")
KIND_HOMES = ("config.py",)
TIER_NAMES = KINDS + ("host", "device")  # (the offload strings and Tier's values)
# What the facade's proxy served until issue 44 (``opt.units``, ``opt.comm``, ...).
ENGINE_NAMES = frozenset(
    "units runs inner swapper comm replicas tp shard_group_ranks gatherer placement reducer scaler policy "
    "frozen_units unit_store grad_links module_guard module param_names optimizer_class config mesh sharding "
    "precision".split())
OPT_HOLDERS = OPT_NAMES + ("zopt", "_opt", "optim")
# The layers above the facade: they take the optimizer from the user (and may name it).
# What reading a DeviceMesh calls (mesh_parsers).
MESH_METHODS = frozenset({"get_group", "get_local_rank", "get_coordinate", "get_all_groups"})
CONSUMERS = ("checkpoint", "integrations", "deepspeed_compat", "train", "bench", "model", "cli.py", "demo", "__init__.py",
             "testing")


def files() -> Iterator[tuple[str, ast.Module]]:
    for folder, _, names in os.walk(ROOT):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, ROOT), ast.parse(f.read(), path)


def module_name(rel: str) -> str:
    parts = ["zeroshard", *rel[:-3].split(os.sep)]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _mentions_any(node: ast.AST | None) -> bool:
    return node is not None and any(isinstance(n, ast.Name) and n.id == "Any" or
                                    isinstance(n, ast.Constant) and isinstance(n.value, str) and "Any" in n.value
                                    for n in ast.walk(node))


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _length(fn: ast.AST) -> int:
    return fn.end_lineno - fn.lineno + 1  # type: ignore[attr-defined]


def _module_imports(tree: ast.Module, package: str, annotations: bool = False) -> set[str]:
    """Modules imported anywhere in the file; under ``if TYPE_CHECKING:`` only if ``annotations``."""
    out: set[str] = set()
    skip = set() if annotations else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING" for b in node.body for n in ast.walk(b)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _reads_a_mesh(tree: ast.Module) -> bool:
    """The file calls a DeviceMesh's methods or reads its names, size or dimensions (mesh_parsers)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr == "mesh_dim_names":
            return True
        if isinstance(n, ast.Constant) and n.value == "mesh_dim_names" and any(
                isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "getattr" and n in c.args
                for c in ast.walk(tree)):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr in MESH_METHODS or n.func.attr == "size" and "mesh" in ast.unparse(n.func.value):
                return True
        if isinstance(n, ast.Attribute) and n.attr == "ndim" and "mesh" in ast.unparse(n.value):
            return True
    return False


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_gatherer(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "gatherer" or isinstance(node, ast.Attribute) and node.attr == "gatherer"


def _gatherer_tests(tree: ast.AST) -> Iterator[ast.AST]:
    """``gatherer is (not) None`` and a gatherer tested for truth (``if gatherer``, ``x if gatherer else y``,
    ``gatherer and ...``, ``not gatherer``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            values = [node.left, *node.comparators]
            if any(_is_gatherer(v) for v in values) and any(isinstance(v, ast.Constant) and v.value is None for v in values):
                yield node
        tested = ([node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else node.values
                  if isinstance(node, ast.BoolOp) else [node.operand] if isinstance(node, ast.UnaryOp)
                  and isinstance(node.op, ast.Not) else [])
        for t in tested:
            if _is_gatherer(t):
                yield t


ENGINE_STATE = frozenset({"closed", "ready"})  # (the engine's documented state: Engine in zero_engine.py)


def _engine_patches(tree: ast.AST) -> Iterator[ast.AST]:
    """Assignments to a field of an engine (``engine.x = ...``, ``e.x = ...``, ``opt.engine.x = ...``,
    augmented too) other than its documented state: an engine filled or changed after it was built."""
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for a in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if (isinstance(a, ast.Attribute) and a.attr not in ENGINE_STATE
                        and (isinstance(a.value, ast.Name) and a.value.id in ("engine", "e")
                             or isinstance(a.value, ast.Attribute) and a.value.attr == "engine")):
                    yield a


def measure() -> dict:
    trees = dict(files())
    modules = {module_name(rel): rel for rel in trees}
    facade = trees[FACADE]
    cls = next(n for n in facade.body if isinstance(n, ast.ClassDef) and n.name == "ZeroOptimizer")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    with open(os.path.join(ROOT, FACADE), encoding="utf-8") as f:
        facade_lines = len(f.read().splitlines())
    taking_any, private_reads, kind_compares, any_count = [], [], [], 0
    auto_branches, string_compares, gatherer_checks, engine_patches = [], [], [], []
    naming_facade, facade_reads, mesh_parsers = [], [], []
    graph: dict[str, set[str]] = {}
    graph_all: dict[str, set[str]] = {}
    folder_edges: set[tuple[str, str]] = set()
    for rel, tree in trees.items():
        mod = module_name(rel)
        package = mod if rel.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        if not rel.endswith("__init__.py"):
            for g, annotations in ((graph, False), (graph_all, True)):
                g[mod] = {m for m in _module_imports(tree, package, annotations)
                          if m in modules and m != mod and not modules[m].endswith("__init__.py")}
        top = rel.split(os.sep)[0]
        for m in _module_imports(tree, package):
            other = modules.get(m, "").split(os.sep)[0] if m in modules else None
            if other and other != top and os.sep in modules[m] and os.sep in rel:
                folder_edges.add((top, other))
        annotations = [a for fn in _functions(tree) for a in
                       [*(x.annotation for x in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs), fn.returns]
                       if a is not None] + [n.annotation for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)]
        if rel != FACADE and not rel.startswith(CONSUMERS) and (any(
                isinstance(n, ast.Name) and n.id == "ZeroOptimizer" or isinstance(n, ast.alias) and n.name == "ZeroOptimizer"
                for n in ast.walk(tree)) or any(isinstance(n, ast.Constant) and "ZeroOptimizer" in str(n.value)
                                                for a in annotations for n in ast.walk(a))):
            naming_facade.append(rel)
        if _reads_a_mesh(tree):
            mesh_parsers.append(rel)
        if rel != FACADE:
            for n in ast.walk(tree):
                if isinstance(n, ast.Attribute) and n.attr in ENGINE_NAMES:
                    v = n.value
                    holder = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
                    if holder in OPT_HOLDERS:
                        facade_reads.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
        gatherer_checks += [f"{rel}:{n.lineno} {ast.unparse(n)}" for n in _gatherer_tests(tree)]
        engine_patches += [f"{rel}:{n.lineno} {ast.unparse(n)}" for n in _engine_patches(tree)]
        for fn in _functions(tree):
            args = fn.args.posonlyargs + fn.args.args
            for a in args + fn.args.kwonlyargs:
                any_count += _mentions_any(a.annotation)
            any_count += _mentions_any(fn.returns)
            if rel != FACADE:
                first = args[0] if args and args[0].arg not in ("self", "cls") else (args[1] if len(args) > 1 else None)
                if first is not None and first.arg in OPT_NAMES and (first.annotation is None or _mentions_any(first.annotation)):
                    taking_any.append(f"{rel}:{fn.lineno} {fn.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign):
                any_count += _mentions_any(node.annotation)
            if (rel != FACADE and isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name) and node.value.id in OPT_NAMES):
                private_reads.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, ast.Compare) and rel not in KIND_HOMES:
                values = [node.left, *node.comparators]
                consts = [v for v in values if isinstance(v, ast.Constant) and v.value in KINDS]
                consts += [e for v in values if isinstance(v, (ast.Tuple, ast.List, ast.Set))
                           for e in v.elts if isinstance(e, ast.Constant) and e.value in KINDS]
                device_type = any(isinstance(v, ast.Attribute) and v.attr == "type" or
                                  "device" in ast.unparse(v) for v in values)  # (a device's type, not an offload kind)
                if consts and not device_type:
                    kind_compares.append(f"{rel}:{node.lineno}")
            if rel.startswith("offload" + os.sep) and (
                    isinstance(node, ast.Attribute) and node.attr in ("auto", "automatic") or isinstance(node, ast.Compare)
                    and any(isinstance(v, ast.Constant) and v.value == "auto" for v in [node.left, *node.comparators])):
                auto_branches.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Compare) and rel != "config.py" and not rel.startswith(CONSUMERS):
                values = [node.left, *node.comparators]
                named = [v for v in values if isinstance(v, ast.Constant) and v.value in TIER_NAMES]
                named += [e for v in values if isinstance(v, (ast.Tuple, ast.List, ast.Set))
                          for e in v.elts if isinstance(e, ast.Constant) and e.value in TIER_NAMES]
                if named and not any(isinstance(v, ast.Attribute) and v.attr == "type" or "device" in ast.unparse(v)
                                     for v in values):
                    string_compares.append(f"{rel}:{node.lineno}")
    getattr_fn = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"), None)
    proxied = 0
    if getattr_fn is not None:
        proxied = next((len(ast.literal_eval(node.value)) if isinstance(node.value, (ast.Set, ast.List, ast.Tuple))
                        else len(ENGINE_NAMES) for node in facade.body if isinstance(node, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == "_ENGINE" for t in node.targets)), len(ENGINE_NAMES))
    both_ways = sorted({tuple(sorted(e)) for e in folder_edges if (e[1], e[0]) in folder_edges})
    by_name: dict[str, list[str]] = {}
    for rel in trees:
        if os.path.basename(rel) not in ("__init__.py", "__main__.py"):
            by_name.setdefault(os.path.basename(rel), []).append(rel)
    duplicates = sorted(rel for rels in by_name.values() if len(rels) > 1 for rel in rels)
    return {
        "facade_lines": facade_lines,
        "facade_constructor_lines": _length(init),
        "facade_longest_function": max(_length(fn) for fn in _functions(cls)),
        "functions_taking_opt_any": len(taking_any),
        "private_reads_of_opt": len(private_reads),
        "import_cycles": len(_cycles(graph)),
        "offload_kind_compares": len(kind_compares),
        "any_annotations": any_count,
        "import_cycles_with_annotations": len(_cycles(graph_all)),
        "below_facade_naming_facade": len(naming_facade),
        "reads_through_facade": len(facade_reads),
        "facade_proxy_names": proxied,
        "sibling_folders_both_ways": len(both_ways),
        "placement_auto_branches": len(auto_branches),
        "offload_string_compares": len(string_compares),
        "mesh_parsers": len(mesh_parsers),
        "gatherer_none_checks": len(gatherer_checks),
        "engine_fields_assigned_after_build": len(engine_patches),
        "duplicate_file_names": len(duplicates),
        "where": {"functions_taking_opt_any": taking_any, "private_reads_of_opt": private_reads,
                  "import_cycles": _cycles(graph), "offload_kind_compares": kind_compares,
                  "import_cycles_with_annotations": _cycles(graph_all),
                  "below_facade_naming_facade": naming_facade, "reads_through_facade": facade_reads,
                  "sibling_folders_both_ways": [f"{a} <-> {b}" for a, b in both_ways],
                  "placement_auto_branches": auto_branches, "offload_string_compares": string_compares,
                  "mesh_parsers": mesh_parsers, "gatherer_none_checks": gatherer_checks,
                  "engine_fields_assigned_after_build": engine_patches,
                  "duplicate_file_names": duplicates},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print every figure and where each is, as JSON")
    parser.add_argument("--where", action="store_true", help="list where each counted item is")
    args = parser.parse_args()
    m = measure()
    if args.json:
        print(json.dumps(m, indent=1))
        return
    for k, v in m.items():
        if k != "where":
            print(f"{k:28s} {v}")
    if args.where:
        for k, items in m["where"].items():
            print(f"\n{k}:")
            for item in items:
                print(f"  {item}")


if __name__ == "__main__":
    main()
