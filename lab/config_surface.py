"""The config surface a user sees: every leaf of the composed config dataclasses (miniverl/config/), and who names it.

    python lab/config_surface.py              # the table and the count, as markdown on stdout
    python lab/config_surface.py --candidates # only the leaves no shipped recipe sets and the README does not name

Issue 75 asks that a key stay user-facing only if a shipped recipe sets it or the README names it; the lab's knobs
become named constants or settings the lab builds directly. This is how that is counted (lab/results/config-surface.md).

A leaf is a dataclass field whose type is not itself a config dataclass (a dict of ModelSpec, like model.teachers, is
one leaf: a user sets it as a whole). `objective` holds one dataclass per objective, so its leaves are the union of
theirs. For each leaf:
- recipes: the shipped conf/ yaml files that set it, read as Hydra places them (a group file's keys sit under its
  group's path, `# @package _global_` at the root; `defaults` lists choose options and set nothing);
- README: the dotted key appears in README.md;
- lab, tests, docs: files under lab/ (its results pages apart), tests/ and docs/ + examples/ that name the dotted key
  (`trainer.probe_every`, so `cfg.trainer.probe_every = 2` counts);
- reads: lines in miniverl/ outside miniverl/config/ that read `.field` (by the field's name alone, so a common name
  such as `seed` over-counts; 0 means nothing outside the config reads it).
Text is matched, nothing is imported but the config dataclasses.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LAB_TEXT = (".py", ".sh", ".txt", ".yaml")  # lab's code, queues and bench configs; its results pages are records


def config_classes():
    """(root dataclass, {section path: dataclasses}); imported here so the module loads without the package."""
    from miniverl.config import OBJECTIVE_CONFIGS, MiniVerlConfig

    return MiniVerlConfig, {"objective": list(OBJECTIVE_CONFIGS.values())}


def leaves(root=None, unions: dict[str, list] | None = None) -> list[str]:
    """Every leaf's dotted key, in field order; `unions` maps a section path to the dataclasses it may hold."""
    if root is None:
        root, unions = config_classes()
    unions = unions or {}
    out: list[str] = []

    def walk(classes: list, prefix: str) -> None:
        seen: set[str] = set()
        for cls in classes:
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                key = f"{prefix}{f.name}"
                if key in seen:
                    continue
                seen.add(key)
                inner = unions.get(key) or ([hints[f.name]] if dataclasses.is_dataclass(hints[f.name]) else None)
                if inner:
                    walk(inner, f"{key}.")
                else:
                    out.append(key)

    walk([root], "")
    return out


def package_of(path: Path, conf: Path) -> str:
    """Where a conf/ file's keys sit in the composed config: its group's path, or the root for _global_ files and
    the composition root itself."""
    head = path.read_text().splitlines()[:1]
    if head and re.match(r"#\s*@package\s+_global_", head[0]):
        return ""
    group = path.parent.relative_to(conf)
    return "" if str(group) == "." else ".".join(group.parts) + "."


def keys_set(path: Path, conf: Path, known: set[str]) -> set[str]:
    """The leaves a conf/ yaml file sets (a mapping under a leaf, like model.teachers' entries, sets that leaf)."""
    doc = yaml.safe_load(path.read_text()) or {}
    found: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if not prefix and key in ("defaults", "hydra"):
                continue
            dotted = f"{prefix}{key}"
            if dotted in known:
                found.add(dotted)
            elif isinstance(value, dict):
                walk(value, f"{dotted}.")

    if isinstance(doc, dict):
        walk(doc, package_of(path, conf))
    return found


def files(under: Path, suffixes: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[Path]:
    return sorted(
        p
        for p in under.rglob("*")
        if p.is_file() and p.suffix in suffixes and not any(part in skip for part in p.relative_to(under).parts)
    )


def naming(key: str, texts: dict[Path, str]) -> list[Path]:
    """The files whose text names the dotted key as a whole (not `trainer.lr` inside `trainer.lr_x` or `xtrainer`)."""
    pattern = re.compile(rf"(?<![\w]){re.escape(key)}(?![\w])")
    return [p for p, text in texts.items() if pattern.search(text)]


@dataclass
class Leaf:
    key: str
    recipes: list[str] = field(default_factory=list)
    readme: bool = False
    lab: int = 0
    tests: int = 0
    docs: int = 0
    reads: int = 0

    @property
    def user_facing(self) -> bool:
        """Issue 75's rule: a shipped recipe sets it, or the README names it."""
        return bool(self.recipes) or self.readme


def survey(root: Path = ROOT, keys: list[str] | None = None) -> list[Leaf]:
    keys = keys if keys is not None else leaves()
    known = set(keys)
    conf = root / "conf"
    by_recipe = {p: keys_set(p, conf, known) for p in files(conf, (".yaml",))}
    readme = (root / "README.md").read_text()
    read = lambda paths: {p: p.read_text(errors="replace") for p in paths}  # noqa: E731
    lab = read(files(root / "lab", LAB_TEXT, skip=("results",)))
    tests = read(files(root / "tests", (".py", ".yaml", ".sh")))
    docs = read(files(root / "docs", (".md",)) + files(root / "examples", (".py",)))
    product = [
        line
        for p in files(root / "miniverl", (".py",), skip=("config",))
        for line in p.read_text().splitlines()
        if not line.lstrip().startswith("#")
    ]
    out = []
    for key in keys:
        name = re.compile(rf"\.{re.escape(key.rsplit('.', 1)[-1])}\b")
        out.append(
            Leaf(
                key=key,
                recipes=sorted(str(p.relative_to(conf)) for p, found in by_recipe.items() if key in found),
                readme=bool(naming(key, {root / "README.md": readme})),
                lab=len(naming(key, lab)),
                tests=len(naming(key, tests)),
                docs=len(naming(key, docs)),
                reads=sum(1 for line in product if name.search(line)),
            )
        )
    return out


def report(rows: list[Leaf], candidates_only: bool = False) -> str:
    facing = [r for r in rows if r.user_facing]
    lines = [
        f"{len(rows)} config leaves; {len(facing)} set by a shipped recipe or named in README.md,"
        f" {len(rows) - len(facing)} by neither (candidates).",
        "",
        "| key | shipped recipes | README | lab files | test files | docs/examples | product reads |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if candidates_only and r.user_facing:
            continue
        recipes = ", ".join(r.recipes) if len(r.recipes) <= 3 else f"{len(r.recipes)} files"
        readme = "yes" if r.readme else "-"
        lines.append(f"| {r.key} | {recipes or '-'} | {readme} | {r.lab} | {r.tests} | {r.docs} | {r.reads} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", action="store_true", help="only leaves no recipe sets and README omits")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    print(report(survey(), candidates_only=args.candidates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
