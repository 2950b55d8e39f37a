"""The project's scripts (scripts/ and lab/, not packages) imported by path, for the tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    """The script at `relative` (from the project root, e.g. "lab/import_graph.py") as a fresh module named after its
    file, registered in sys.modules while it runs (a script's dataclasses look their module up there)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
