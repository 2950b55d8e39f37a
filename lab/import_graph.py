"""The import graph of the miniverl package, read with `ast` (nothing is imported).

    python lab/import_graph.py            # per module: its miniverl imports, fan-in, fan-out; then cycles
    python lab/import_graph.py --summary  # only the largest fan-out and the cycles

Fan-out counts every miniverl module a module imports, at module level or inside a function (a lazy
import is still a dependency); cycles count module-level imports only, the ones Python runs at import.
lab/cfg_walk.py follows one parameter through the calls and reads each module's floor from here.
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
    path: Path
    imports: set[str] = field(default_factory=set)  # every miniverl import
    eager: set[str] = field(default_factory=set)  # module-level imports only (outside functions)
    names: dict[str, str] = field(default_factory=dict)  # what its imports outside functions bind: name -> dotted


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(target: str, known: set[str], names: dict[str, dict[str, str]] | None = None) -> str | None:
    """`miniverl.a.b.C` names module miniverl.a.b (the longest known prefix). With `names` (module -> what its
    imports bind), a name a module only imports is followed to where it comes from: `miniverl.config.to_config`
    to miniverl.config.schema when config/__init__.py re-exports it from there."""
    seen = set()
    while target and target not in seen:  # seen: two modules importing a name from each other
        if target in known:
            return target
        seen.add(target)
        owner, _, name = target.rpartition(".")
        target = names[owner][name] if names is not None and name in names.get(owner, {}) else owner
    return None


def import_bindings(node: ast.AST, here: str, is_package: bool) -> list[tuple[str, str]]:
    """What an import statement binds in module `here`, as (name, dotted target): `from a.b import c as d` binds
    d to a.b.c, `import a.b as e` binds e to a.b, `import a.b` binds a to a."""
    if isinstance(node, ast.Import):
        return [(a.asname, a.name) if a.asname else (a.name.partition(".")[0],) * 2 for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from .x import y
            base = here.split(".")[: len(here.split(".")) - node.level + (1 if is_package else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [(a.asname or a.name, f"{prefix}.{a.name}") for a in node.names]
    return []


def _imported(node: ast.AST, here: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [target for _, target in import_bindings(node, here, is_package)]


def _module_level(tree: ast.Module, type_checking: bool) -> set[ast.AST]:
    """The nodes outside every def (if/try blocks included; `if TYPE_CHECKING:` blocks only with `type_checking`)."""
    found, stack = set(), list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        found.add(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def build_graph(root: Path = ROOT, through_reexports: bool = False) -> dict[str, Module]:
    """Every module under `root` (a package folder) with the package modules it imports. With `through_reexports`
    an import of a name that a module only re-exports counts as an import of the module defining it (what the
    importer uses) rather than of the re-exporting package (what Python runs first)."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root): Module(module_name(f, root), f) for f in files}
    trees = {name: ast.parse(mod.path.read_text(), str(mod.path)) for name, mod in modules.items()}
    for name, mod in modules.items():
        imports = [n for n in _module_level(trees[name], True) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in sorted(imports, key=lambda n: n.lineno):  # a later import of a name wins, as in Python
            mod.names.update(import_bindings(node, name, mod.path.name == "__init__.py"))
    known = set(modules)
    names = {name: mod.names for name, mod in modules.items()} if through_reexports else None
    for name, mod in modules.items():
        eager_nodes = _module_level(trees[name], type_checking=False)
        for node in ast.walk(trees[name]):
            for target in _imported(node, name, mod.path.name == "__init__.py"):
                dep = _resolve(target, known, names)
                if dep is None or dep == name:
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


def floors(modules: dict[str, Module]) -> dict[str, int]:
    """Each module's floor: 1 for a module importing no other package module, else 1 + the highest floor among the
    modules it imports (every import, lazy ones included). The modules of a circle share one floor."""
    circle_of = {name: (name,) for name in modules}
    for circle in cycles(modules, lazy=True):
        circle_of.update(dict.fromkeys(circle, tuple(circle)))
    found: dict[tuple[str, ...], int] = {}

    def floor(circle: tuple[str, ...]) -> int:
        if circle not in found:
            below = {circle_of[dep] for name in circle for dep in modules[name].imports} - {circle}
            found[circle] = 1 + max(map(floor, below), default=0)
        return found[circle]

    return {name: floor(circle_of[name]) for name in modules}


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
