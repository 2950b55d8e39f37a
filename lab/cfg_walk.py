"""Follow one parameter through the package's calls, read with `ast` (nothing is imported or run):

    python lab/cfg_walk.py miniverl/main.py:train:cfg [--events 400]   # path:function (or Class.method):parameter

Issue 36 asks that following `cfg` from main stay within 40 stays and 5 climbs; this is how that is measured. It
prints one line per stay, then the counts. A stay is a run of consecutive calls into one module (the first is the
starting function's); returning to a caller's module and calling on there starts a new stay. A stay is on its
module's floor (lab/import_graph.py's `floors`, imports counted through re-exports), and is a climb, UP n, when
that is n floors above the stay before.

What is followed, statically (both branches of an if, each loop body once, a call's arguments before the call):
- tracked names: the parameter, and every local bound from an expression mentioning a tracked name (assignment,
  augmented assignment, unpacking, for, comprehension, with-as, walrus); `self.attr = <tracked>` makes `attr` a
  tracked member of the class, which every method reading `self.attr` then carries;
- an event: a call whose arguments, or receiver (`x` in `x.m(...)`), mention a tracked name, or whose receiver's class
  has a tracked member, and whose callee package_defs.py finds in the package. `Class(...)` enters its __init__;
  a dataclass, a NamedTuple or a class without __init__ is one event with nothing to walk;
- the callee's body is walked before the caller goes on, tracking the parameters given tracked arguments (a method's
  self when its receiver is tracked: then all of self is). A function already on the call stack is not entered
  again (recursion); the walk stops after --events calls.
Not followed: calls through objects of unknown class (registries, Protocols, Ray actors), nested defs and lambdas.
Members are per class, not per object.

`--follow config` follows the config itself instead of every value computed from it: a name is tracked only when it
is bound to a tracked name, to a section of one (`cfg.trainer`, `cfg.model.teachers[name]`, `.items()`/`.values()`
/`.get()` of a mapping of sections), a section being a field of a class of the package's `config` folder whose
annotation names such a class; and a call is an event only when an argument or its receiver is such a value. So
`f(cfg.trainer)` is an event and `f(cfg.trainer.total_steps)` is not: f gets a number, not the config. This is
the walk of the issue's complaint (which modules read the config, back and forth); `--follow values` (the default)
is the wider data flow.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from import_graph import ROOT, module_name
from package_defs import Func, Klass, Package, Scope, member_of, parameters

DEFAULT_EVENTS = 400  # issue 36's cap; the whole trip from main.train ran to 1,051 calls when this was written


@dataclass
class Frame:
    """One function being walked: the names it tracks, and the package class of some of its locals."""

    func: Func
    scope: Scope
    tracked: set[str]
    types: dict[str, Klass]


@dataclass
class Stay:
    index: int
    floor: int
    module: str
    entered: str  # the first function entered in this stay
    calls: int
    up: int  # floors climbed from the stay before (0: not a climb)


@dataclass
class Trip:
    stays: list[Stay]
    events: list[str]  # every call followed, as module:function
    cut: int | None  # the cap that cut the walk, or None when it ran to the end

    @property
    def climbs(self) -> int:
        return sum(1 for s in self.stays if s.up > 0)

    @property
    def modules(self) -> int:
        return len({s.module for s in self.stays})


class _Cut(Exception):
    """The events cap is reached: unwind the whole walk."""


class Walker:
    """The walk's state: the events so far, the call stack, and each class's tracked members."""

    def __init__(self, package: Package, cap: int, follow: str = "values"):
        self.package, self.cap = package, cap
        self.config = config_classes(package) if follow == "config" else {}  # by name
        # --follow config: the field names holding config sections; None: follow every value
        self.sections = config_sections(self.config) if follow == "config" else None
        self.events: list[Func] = []
        self.stack: list[Func] = []
        self.members: dict[Klass, set[str]] = defaultdict(set)  # tracked `self.attr` names of each class

    def enter(self, func: Func, tracked: set[str]) -> None:
        scope = self.package.scope(func)
        frame = Frame(func, scope, set(tracked), {})
        for arg in parameters(func.node.args):
            klass = self.package.annotated(arg.annotation, scope)
            if klass is not None:
                frame.types[arg.arg] = klass
        self.stack.append(func)
        try:
            for statement in func.node.body:
                self.visit(statement, frame)
        finally:
            self.stack.pop()

    def mentions(self, expr: ast.AST | None, frame: Frame) -> bool:
        if self.sections is not None:
            return expr is not None and self.is_config(expr, frame)
        members = self.members.get(frame.scope.klass, set())
        for node in ast.walk(expr) if expr is not None else ():
            if isinstance(node, ast.Name) and node.id in frame.tracked:
                return True
            if isinstance(node, ast.Attribute) and member_of(node, frame.scope.self_name) in members:
                return True
        return False

    def is_config(self, expr: ast.AST, frame: Frame) -> bool:
        """--follow config: `expr` is the tracked config or one of its sections, not a value read from them."""
        if isinstance(expr, ast.Name):
            return expr.id in frame.tracked
        if isinstance(expr, ast.Attribute):
            if member_of(expr, frame.scope.self_name) == expr.attr and expr.attr in self.members.get(
                frame.scope.klass, ()
            ):
                return True  # self.attr, a tracked member
            if self.type_of(expr, frame) in self.config.values():
                return True  # annotated as a config class, whatever holds it (a record carrying the config)
            return expr.attr in self.sections and self.is_config(expr.value, frame)
        if isinstance(expr, ast.Subscript):
            return self.is_config(expr.value, frame)
        if isinstance(expr, ast.Call):  # a mapping of sections' items, or a function annotated to return sections
            mapping = isinstance(expr.func, ast.Attribute) and expr.func.attr in ("items", "values", "get")
            if mapping and self.is_config(expr.func.value, frame):
                return True
            found = self.package.resolve(expr.func, frame.scope)
            returns = found.node.returns if isinstance(found, Func) and found.node is not None else None
            return returns is not None and bool(self.config.keys() & names_in(returns))
        if isinstance(expr, (ast.Tuple, ast.List, ast.Starred, ast.IfExp, ast.BoolOp)):
            parts = (expr.body, expr.orelse) if isinstance(expr, ast.IfExp) else ast.iter_child_nodes(expr)
            return any(self.is_config(p, frame) for p in parts)
        return False

    def bind(self, target: ast.expr, frame: Frame, carried: bool, value: ast.expr | None = None) -> None:
        """An assignment to `target`: tracked if what it receives is; a local's class is noted."""
        if isinstance(target, ast.Name) and value is not None:
            klass = self.package.made(value, frame.scope)
            if klass is not None:
                frame.types[target.id] = klass
        if not carried:
            return
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.bind(element, frame, carried)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, frame, carried)
        elif member_of(target, frame.scope.self_name) is not None:
            self.members[frame.scope.klass].add(member_of(target, frame.scope.self_name))
        else:  # a name, or `x.y = ...` / `x[k] = ...`: x now holds the tracked value
            while isinstance(target, (ast.Attribute, ast.Subscript)):
                target = target.value
            if isinstance(target, ast.Name):
                frame.tracked.add(target.id)

    def assign(self, target: ast.expr, value: ast.expr, frame: Frame) -> None:
        """`a, b = x, y` pairs each name with its own value; any other unpacking takes the whole value's."""
        pairs = isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
        if pairs and len(target.elts) == len(value.elts) and not any(isinstance(e, ast.Starred) for e in value.elts):
            for element, part in zip(target.elts, value.elts):
                self.assign(element, part, frame)
            return
        self.bind(target, frame, self.mentions(value, frame), value)

    def visit(self, node: ast.AST, frame: Frame) -> None:
        """Walk a statement or expression in the order it runs, binding names and following calls."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return  # a nested def's body runs when (if) it is called; its calls are not followed
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            if node.value is None:
                return
            self.visit(node.value, frame)
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                self.assign(target, node.value, frame)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self.visit(node.iter, frame)
            self.bind(node.target, frame, self.mentions(node.iter, frame))
            for statement in node.body + node.orelse:
                self.visit(statement, frame)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                self.visit(item.context_expr, frame)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, frame, self.mentions(item.context_expr, frame), item.context_expr)
            for statement in node.body:
                self.visit(statement, frame)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for generator in node.generators:
                self.visit(generator.iter, frame)
                self.bind(generator.target, frame, self.mentions(generator.iter, frame))
                for condition in generator.ifs:
                    self.visit(condition, frame)
            for part in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
                self.visit(part, frame)
        else:
            for child in ast.iter_child_nodes(node):  # a call's receiver and arguments run before the call
                self.visit(child, frame)
            if isinstance(node, ast.Call):
                self.call(node, frame)

    def callee(self, call: ast.Call, frame: Frame) -> tuple[Func, ast.expr | None, bool] | None:
        """(function, receiver bound to its first parameter, whether its first parameter is bound implicitly)."""
        func, package = call.func, self.package
        if isinstance(func, ast.Attribute):  # x.m(...) on an object of a known package class
            klass = self.type_of(func.value, frame)
            found = package.method(klass, func.attr) if klass is not None else None
            if found is not None and found.decorated("staticmethod"):
                return found, None, False
            if found is not None:
                return found, func.value, True
        found = package.resolve(func, frame.scope)
        if isinstance(found, Klass):  # Class(...): its __init__ with a new self, or one body-less event
            init = None if found.record else package.method(found, "__init__")
            return (init, None, True) if init else (Func(found.module, found.node.name, None, found), None, False)
        if isinstance(found, Func):  # f(...), mod.f(...), Class.m(...): a classmethod's cls is implicit
            return found, None, found.decorated("classmethod")
        return None

    def type_of(self, expr: ast.expr, frame: Frame) -> Klass | None:
        """The package class of a receiver: `self`, a local or parameter, `self.attr`, `C(...)` or `f(...) -> C`."""
        self_name = frame.scope.self_name
        if isinstance(expr, ast.Name):
            return frame.scope.klass if expr.id == self_name else frame.types.get(expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == self_name:
            return self.package.member_type(frame.scope.klass, expr.attr)
        if isinstance(expr, ast.Attribute):  # `x.attr` of an object of a known class: its annotated member
            owner = self.type_of(expr.value, frame)
            return self.package.member_type(owner, expr.attr) if owner is not None else None
        return self.package.made(expr, frame.scope)

    def call(self, call: ast.Call, frame: Frame) -> None:
        found = self.callee(call, frame)
        if found is None:
            return
        func, receiver, implicit_first = found
        # `x.m()` on an object whose class has a tracked member (`self.m()` included): it carries the value to m
        carries = receiver is not None and bool(self.members.get(self.type_of(receiver, frame)))
        receiver_tracked = receiver is not None and (self.mentions(receiver, frame) or carries)
        arguments = [*call.args, *(k.value for k in call.keywords)]
        if not receiver_tracked and not any(self.mentions(a, frame) for a in arguments):
            return
        if func in self.stack:
            return  # recursion: not entered again
        self.events.append(func)
        if len(self.events) >= self.cap:
            raise _Cut
        if func.node is None:  # a record or a class without __init__: nothing to walk
            return
        node = func.node
        positional = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
        first = positional.pop(0) if implicit_first and positional else None
        keyword = positional + [a.arg for a in node.args.kwonlyargs]
        tracked = self.parameters(positional, keyword, call, frame, node.args.vararg, node.args.kwarg)
        if first is not None and receiver is not None and self.mentions(receiver, frame):
            tracked.add(first)
        self.enter(func, tracked)

    def parameters(self, positional, keyword, call, frame, vararg, kwarg) -> set[str]:
        """The parameters that receive a tracked argument (all of them after a tracked *args or **kwargs)."""
        tracked = set()
        for i, arg in enumerate(call.args):
            if isinstance(arg, ast.Starred):  # the positions after it are unknown
                if self.mentions(arg.value, frame):
                    tracked |= set(positional[i:]) | ({vararg.arg} if vararg else set())
                break
            if self.mentions(arg, frame):
                tracked |= {positional[i]} if i < len(positional) else {vararg.arg} if vararg else set()
        for kw in call.keywords:
            if not self.mentions(kw.value, frame):
                continue
            if kw.arg is None:
                tracked |= set(keyword) | ({kwarg.arg} if kwarg else set())
            elif kw.arg in keyword or kwarg:
                tracked.add(kw.arg if kw.arg in keyword else kwarg.arg)
        return tracked


def names_in(annotation: ast.expr) -> set[str]:
    """The names an annotation mentions, inside quotes too (`dict[str, "ModelSpec"] | None`: dict, str, ModelSpec)."""
    out = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            with contextlib.suppress(SyntaxError):  # a docstring-like constant, not a quoted name
                out |= names_in(ast.parse(node.value, mode="eval").body)
    return out


def config_classes(package: Package) -> dict[str, Klass]:
    """The classes of the package's `config` folder, by name."""
    return {
        name: klass
        for module, classes in package.classes.items()
        if module.split(".")[1:2] == ["config"]
        for name, klass in classes.items()
    }


def config_sections(config: dict[str, Klass]) -> set[str]:
    """The field names of the config classes whose annotation names one of them (`trainer`, `teachers`, ...)."""
    return {
        node.target.id
        for klass in config.values()
        for node in klass.node.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if set(config) & names_in(node.annotation)
    }


def walk(spec: str, events: int = DEFAULT_EVENTS, root: Path = ROOT, follow: str = "values") -> Trip:
    """Follow `path:function:parameter` (path from the package's parent folder, function as `f` or `Class.m`) for
    at most `events` calls, in the package at `root`; `follow` is "values" (all computed from it) or "config"."""
    if spec.count(":") != 2:
        raise ValueError(f"{spec!r} is not path:function:parameter")
    path, qualname, parameter = spec.split(":")
    package = Package(root)
    found = package.lookup(f"{module_name(root.parent / path, root)}.{qualname}")
    if not isinstance(found, Func):
        raise ValueError(f"no function {qualname} in {path}")
    if follow not in ("values", "config"):
        raise ValueError(f"follow={follow!r}: use values or config")
    walker = Walker(package, events, follow)
    try:
        walker.enter(found, {parameter})
        cut = None
    except _Cut:
        cut = events
    stays: list[Stay] = []
    for func in [found, *walker.events]:  # the starting function opens the first stay
        if stays and stays[-1].module == func.module:
            stays[-1].calls += 1
            continue
        floor = package.floors[func.module]
        up = floor - stays[-1].floor if stays and floor > stays[-1].floor else 0
        stays.append(Stay(len(stays) + 1, floor, func.module, func.qualname, 1, up))
    return Trip(stays, [f"{f.module}:{f.qualname}" for f in walker.events], cut)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="path:function:parameter, e.g. miniverl/main.py:train:cfg")
    parser.add_argument("--events", type=int, default=DEFAULT_EVENTS, help="stop after this many calls")
    parser.add_argument("--follow", choices=("values", "config"), default="values", help="what is followed")
    args = parser.parse_args()
    try:
        trip = walk(args.spec, args.events, follow=args.follow)
    except ValueError as e:
        parser.error(str(e))
    for s in trip.stays:
        calls = f"  ({s.calls} calls)" if s.calls > 1 else ""
        up = f"  UP {s.up}" if s.up else ""
        print(f"{s.index:4}  floor {s.floor:2}  {s.module}  {s.entered}{calls}{up}")
    ending = f"cut at {trip.cut}" if trip.cut else "whole"
    counts = f"stays {len(trip.stays)}, modules {trip.modules}, climbs {trip.climbs}, events {len(trip.events)}"
    print(f"{counts} ({ending})")


if __name__ == "__main__":
    main()
