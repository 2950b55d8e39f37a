"""The import graph of the miniverl package, read with `ast` (nothing is imported).

    python scripts/import_graph.py            # per module: its miniverl imports, fan-in, fan-out; then cycles
    python scripts/import_graph.py --summary  # only the largest fan-out and the cycles

Fan-out counts every miniverl module a module imports, at module level or inside a function (a lazy
import is still a dependency); cycles count module-level imports only, the ones Python runs at import.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "miniverl"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


@dataclass
class Module:
    name: str
    imports: set[str] = field(default_factory=set)  # every miniverl import
    eager: set[str] = field(default_factory=set)  # module-level imports only (outside functions)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(target: str, known: set[str]) -> str | None:
    """`miniverl.a.b.C` names module miniverl.a.b (the longest known prefix)."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def _imported(node: ast.AST, here: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from .x import y
            base = here.split(".")[: len(here.split(".")) - node.level + (1 if is_package else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [f"{prefix}.{a.name}" for a in node.names]
    return []


def build_graph(root: Path = ROOT) -> dict[str, Module]:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root): Module(module_name(f, root)) for f in files}
    known = set(modules)
    for f in files:
        mod = modules[module_name(f, root)]
        tree = ast.parse(f.read_text(), str(f))
        eager_nodes = set()
        stack = list(ast.iter_child_nodes(tree))
        while stack:  # module level: everything outside a def (if/try blocks included; TYPE_CHECKING excepted)
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            eager_nodes.add(node)
            stack.extend(ast.iter_child_nodes(node))
        for node in ast.walk(tree):
            for target in _imported(node, mod.name, f.name == "__init__.py"):
                dep = _resolve(target, known)
                if dep is None or dep == mod.name:
                    continue
                mod.imports.add(dep)
                if node in eager_nodes:
                    mod.eager.add(dep)
    return modules


def fan_in(modules: dict[str, Module]) -> dict[str, int]:
    counts = dict.fromkeys(modules, 0)
    for mod in modules.values():
        for dep in mod.imports:
            counts[dep] += 1
    return counts


def cycles(modules: dict[str, Module], lazy: bool = False) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan) over module-level imports, or with
    `lazy` over every import (a function-level import that closes a circle still ties the two together)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(modules[v].imports if lazy else modules[v].eager):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="only the largest fan-out and the cycles")
    args = parser.parse_args()
    modules = build_graph()
    fin = fan_in(modules)
    if not args.summary:
        for name in sorted(modules):
            mod = modules[name]
            deps = ", ".join(d.removeprefix(f"{PACKAGE}.") for d in sorted(mod.imports)) or "-"
            print(f"{name}  in={fin[name]} out={len(mod.imports)}\n    {deps}")
    top = sorted(modules.values(), key=lambda m: -len(m.imports))[:5]
    print(f"\n{len(modules)} modules; largest fan-out:")
    for mod in top:
        print(f"  {mod.name}: {len(mod.imports)} ({len(mod.imports) / (len(modules) - 1):.0%} of the others)")
    for title, lazy in (("module level", False), ("function-level imports included", True)):
        found = cycles(modules, lazy)
        print(f"import cycles ({title}): " + ("none" if not found else ""))
        for c in found:
            print("  " + " <-> ".join(c))


if __name__ == "__main__":
    main()
