"""The package's functions and classes, and what a name written in one of its modules refers to, read with `ast`.

lab/cfg_walk.py asks it which function a call reaches: `f(...)` for a function of the module or imported from
the package (at module level or inside the function), `mod.f(...)`, `Class(...)`, `Class.m(...)`, and `x.m(...)`
where the class of x is known from an annotation or from what built it. Names are followed through re-exports
(`from miniverl.config import to_config` reaches config/schema.py).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from import_graph import build_graph, floors, import_bindings

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(eq=False)  # compared by identity: one object per class of the package
class Klass:
    module: str
    node: ast.ClassDef
    record: bool  # a dataclass or NamedTuple: its __init__ is generated from the fields, so it has no body to walk


@dataclass(frozen=True)
class Func:
    module: str
    qualname: str  # "f" or "Class.method"; "Class" for a class constructed without an __init__ to walk
    node: FunctionNode | None = field(compare=False)  # None: nothing to walk
    klass: Klass | None = field(default=None, compare=False)

    def decorated(self, name: str) -> bool:
        return self.node is not None and any(ast.unparse(d) == name for d in self.node.decorator_list)


@dataclass
class Scope:
    """Where a name is read: a module, or a function of it (its own imports and locals first)."""

    module: str
    imports: dict[str, str] = field(default_factory=dict)  # what the function's import statements bind -> dotted
    local: set[str] = field(default_factory=set)  # parameters and assigned names: values, not the module's defs
    klass: Klass | None = None  # the class of a method
    self_name: str | None = None  # a method's first parameter (not for a staticmethod or classmethod)


def parameters(args: ast.arguments) -> list[ast.arg]:
    return [*args.posonlyargs, *args.args, *([args.vararg] if args.vararg else []), *args.kwonlyargs]


def member_of(expr: ast.expr, self_name: str | None) -> str | None:
    """`attr` for `self.attr` (also inside `self.attr[k]`, `self.attr.x`), else None."""
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == self_name:
            return expr.attr
        expr = expr.value
    return None


class Package:
    """Every module's functions and classes by name, each module's floor, and name resolution."""

    def __init__(self, root: Path):
        self.graph = build_graph(root, through_reexports=True)
        self.floors = floors(self.graph)
        self.functions: dict[str, dict[str, FunctionNode]] = {}
        self.classes: dict[str, dict[str, Klass]] = {}
        for name, mod in self.graph.items():
            body = ast.parse(mod.path.read_text(), str(mod.path)).body
            self.functions[name] = {n.name: n for n in body if isinstance(n, FunctionNode)}
            self.classes[name] = {n.name: _klass(name, n) for n in body if isinstance(n, ast.ClassDef)}

    def scope(self, func: Func) -> Scope:
        node, module = func.node, func.module
        is_package = self.graph[module].path.name == "__init__.py"  # for a relative import
        imports = {}
        for child in ast.walk(node):
            imports.update(import_bindings(child, module, is_package))
        local = {a.arg for a in parameters(node.args)} | ({node.args.kwarg.arg} if node.args.kwarg else set())
        local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        is_method = func.klass and not func.decorated("staticmethod") and not func.decorated("classmethod")
        positional = [*node.args.posonlyargs, *node.args.args]
        self_name = positional[0].arg if is_method and positional else None
        return Scope(module, imports, local - set(imports), func.klass, self_name)

    def lookup(self, dotted: str) -> str | Func | Klass | None:
        """`pkg.mod` (a module: its name), `pkg.mod.f`, `pkg.mod.Class`, `pkg.mod.Class.m`, through re-exports."""
        seen = set()
        while dotted not in seen:  # seen: two modules importing a name from each other
            seen.add(dotted)
            if dotted in self.graph:
                return dotted
            owner = max((m for m in self.graph if dotted.startswith(m + ".")), key=len, default=None)
            if owner is None:
                return None
            first, *rest = dotted[len(owner) + 1 :].split(".")
            if first in self.classes[owner] and len(rest) <= 1:
                klass = self.classes[owner][first]
                return self.method(klass, rest[0]) if rest else klass
            if first in self.functions[owner] and not rest:
                return Func(owner, first, self.functions[owner][first])
            if first not in self.graph[owner].names:
                return None  # a constant, or a name from outside the package
            dotted = ".".join([self.graph[owner].names[first], *rest])
        return None

    def resolve(self, expr: ast.expr, scope: Scope) -> str | Func | Klass | None:
        """What a name or attribute chain (or a quoted annotation) read in `scope` refers to."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            try:
                return self.resolve(ast.parse(expr.value, mode="eval").body, scope)
            except SyntaxError:
                return None
        if isinstance(expr, ast.Name):
            if expr.id in scope.imports:
                return self.lookup(scope.imports[expr.id])
            return None if expr.id in scope.local else self.lookup(f"{scope.module}.{expr.id}")
        if isinstance(expr, ast.Attribute):
            base = self.resolve(expr.value, scope)
            if isinstance(base, str):
                return self.lookup(f"{base}.{expr.attr}")
            if isinstance(base, Klass):
                return self.method(base, expr.attr)
        return None

    def method(self, klass: Klass, name: str, seen: frozenset = frozenset()) -> Func | None:
        """`name` defined in the class or, failing that, in one of its package bases."""
        for node in klass.node.body:
            if isinstance(node, FunctionNode) and node.name == name:
                return Func(klass.module, f"{klass.node.name}.{name}", node, klass)
        for base in klass.node.bases:
            found = self.resolve(base, Scope(klass.module))
            if isinstance(found, Klass) and found not in seen:
                inherited = self.method(found, name, seen | {klass})
                if inherited is not None:
                    return inherited
        return None

    def annotated(self, annotation: ast.expr | None, scope: Scope) -> Klass | None:
        """The package class an annotation names: `C`, `C | None`, `Optional[C]`, `"C"`."""
        if isinstance(annotation, ast.BinOp):
            return self.annotated(annotation.left, scope) or self.annotated(annotation.right, scope)
        if isinstance(annotation, ast.Subscript):
            return self.annotated(annotation.slice, scope)
        found = self.resolve(annotation, scope) if annotation is not None else None
        return found if isinstance(found, Klass) else None

    def made(self, value: ast.expr, scope: Scope) -> Klass | None:
        """The package class of what a call returns: `C(...)`, or a function annotated `-> C`."""
        found = self.resolve(value.func, scope) if isinstance(value, ast.Call) else None
        if isinstance(found, Func) and found.node is not None:
            return self.annotated(found.node.returns, Scope(found.module))
        return found if isinstance(found, Klass) else None

    def member_type(self, klass: Klass, attr: str) -> Klass | None:
        """The class of `self.attr`: a class-level annotation, or `self.attr = C(...)` / an annotated parameter."""
        for node in klass.node.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
                return self.annotated(node.annotation, Scope(klass.module))
        for method in (n for n in klass.node.body if isinstance(n, FunctionNode)):
            scope = self.scope(Func(klass.module, method.name, method, klass))
            annotations = {a.arg: a.annotation for a in parameters(method.args)}
            for node in ast.walk(method):
                if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if all(member_of(t, scope.self_name) != attr for t in targets):
                    continue
                if isinstance(node, ast.AnnAssign):
                    return self.annotated(node.annotation, scope)
                if isinstance(node.value, ast.Name) and node.value.id in annotations:
                    return self.annotated(annotations[node.value.id], scope)
                return self.made(node.value, scope)
        return None


def _klass(module: str, node: ast.ClassDef) -> Klass:
    decorators = {ast.unparse(d).split("(")[0] for d in node.decorator_list}
    bases = {ast.unparse(b) for b in node.bases}
    record = decorators & {"dataclass", "dataclasses.dataclass"} or bases & {"NamedTuple", "typing.NamedTuple"}
    return Klass(module, node, bool(record))
