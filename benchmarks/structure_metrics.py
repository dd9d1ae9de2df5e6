"""The structure figures issue 26 tracks, measured from the source (``python benchmarks/structure_metrics.py``).

Each figure is counted from the syntax tree, not from text, so comments and strings do not
count. ``--json`` prints them as JSON (tests/test_structure.py reads them as a ratchet).

- facade_lines, facade_constructor_lines, facade_longest_function: ``optim/zero_optimizer.py``;
- functions_taking_opt_any: functions outside the facade whose first parameter is the
  optimizer (named ``opt``/``optimizer``/``zero``) annotated ``Any`` or not annotated;
- private_reads_of_opt: ``opt._x`` attribute reads outside the facade's file;
- import_cycles: strongly connected groups of files that import each other, counting the
  imports inside functions (a lazy import hides a circle, it does not remove it); a package's
  ``__init__`` re-exporting its files is left out;
- offload_kind_compares: comparisons with "nvme"/"cpu"/"auto" outside ``config.py`` and the
  placement policy (``offload/placement.py``), not counting a device's type (``x.device.type == "cpu"``);
- any_annotations: annotations that are or contain ``Any``.
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
KIND_HOMES = ("config.py", os.path.join("offload", "placement.py"))


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


def _module_imports(tree: ast.Module, package: str) -> set[str]:
    """Modules imported anywhere in the file except under ``if TYPE_CHECKING:``."""
    out: set[str] = set()
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
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


def measure() -> dict:
    trees = dict(files())
    modules = {module_name(rel): rel for rel in trees}
    facade = trees[FACADE]
    cls = next(n for n in facade.body if isinstance(n, ast.ClassDef) and n.name == "ZeroOptimizer")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    with open(os.path.join(ROOT, FACADE), encoding="utf-8") as f:
        facade_lines = len(f.read().splitlines())
    taking_any, private_reads, kind_compares, any_count = [], [], [], 0
    graph: dict[str, set[str]] = {}
    for rel, tree in trees.items():
        mod = module_name(rel)
        package = mod if rel.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        if not rel.endswith("__init__.py"):
            graph[mod] = {m for m in _module_imports(tree, package)
                          if m in modules and m != mod and not modules[m].endswith("__init__.py")}
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
    return {
        "facade_lines": facade_lines,
        "facade_constructor_lines": _length(init),
        "facade_longest_function": max(_length(fn) for fn in _functions(cls)),
        "functions_taking_opt_any": len(taking_any),
        "private_reads_of_opt": len(private_reads),
        "import_cycles": len(_cycles(graph)),
        "offload_kind_compares": len(kind_compares),
        "any_annotations": any_count,
        "where": {"functions_taking_opt_any": taking_any, "private_reads_of_opt": private_reads,
                  "import_cycles": _cycles(graph), "offload_kind_compares": kind_compares},
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
