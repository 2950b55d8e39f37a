"""The house and the lab: `miniverl` (the installed package) never imports `lab` (the benchmarks, measurements and
their results, beside it in the repository), so the product runs without the lab; and the lab's entry point runs
from its own place."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "miniverl"


def lab_imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every import of `lab` or a module under it in one file, at module level or inside a function, and every
    `import_module("lab...")`-style call naming it in a string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            names = [node.args[0].value] if func in ("import_module", "__import__") else []
        else:
            continue
        found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n == "lab" or n.startswith("lab.")]
    return found


def test_no_module_of_the_package_imports_the_lab():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50  # the scan reads the real package, not an empty folder
    assert [hit for m in modules for hit in lab_imports(m)] == []


def test_the_scan_sees_every_form_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import lab.bench\nfrom lab import bench\nimport laboratory\n"
        "def f():\n    from lab.bench.peers import x\n    importlib.import_module('lab.bench')\n"
    )
    hits = [h.split(": ")[1] for h in lab_imports(probe, tmp_path)]
    assert hits == ["lab.bench", "lab", "lab.bench.peers", "lab.bench"]


def test_the_lab_is_not_installed_with_the_package():
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    installed = find_packages(str(ROOT), include=find["include"])
    assert "miniverl" in installed and not [p for p in installed if p == "lab" or p.startswith("lab.")]


def test_the_lab_bench_entry_point_runs_from_its_place():
    out = subprocess.run(
        [sys.executable, "-m", "lab.bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "rollout-smoke" in out.stdout  # the bench group is read from lab/conf/bench/
