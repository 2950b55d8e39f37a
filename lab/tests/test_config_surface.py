"""lab/config_surface.py: the config leaves a user sees and who sets or names them (issue 75's count)."""

from __future__ import annotations

import importlib
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]


@pytest.fixture
def surface(monkeypatch):
    monkeypatch.syspath_prepend(str(LAB))
    return importlib.import_module("config_surface")


@dataclass
class Inner:
    a: int = 0
    table: dict[str, int] = field(default_factory=dict)  # a dict is one leaf, set as a whole


@dataclass
class ObjA:
    name: str = "a"
    x: float = 0.0


@dataclass
class ObjB:
    name: str = "b"
    y: float = 0.0


@dataclass
class Root:
    inner: Inner = field(default_factory=Inner)
    objective: ObjA = field(default_factory=ObjA)
    top: bool = True


def test_leaves_walk_sections_and_union_the_objectives(surface):
    assert surface.leaves(Root, {"objective": [ObjA, ObjB]}) == [
        "inner.a",
        "inner.table",
        "objective.name",
        "objective.x",
        "objective.y",
        "top",
    ]


def test_a_recipe_sets_keys_where_hydra_places_them(surface, tmp_path):
    conf = tmp_path / "conf"
    (conf / "inner").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "inner" / "small.yaml").write_text("a: 3\n")
    (conf / "experiment" / "e.yaml").write_text(
        textwrap.dedent("""\
            # @package _global_
            defaults:
              - override /inner: small
            inner:
              table: {k: 1}
            top: false
            """)
    )
    known = {"inner.a", "inner.table", "top"}
    assert surface.keys_set(conf / "inner" / "small.yaml", conf, known) == {"inner.a"}
    assert surface.keys_set(conf / "experiment" / "e.yaml", conf, known) == {"inner.table", "top"}


def test_naming_matches_the_whole_dotted_key(surface, tmp_path):
    texts = {tmp_path / "a": "cfg.trainer.lr = 1", tmp_path / "b": "trainer.lr_x=1 xtrainer.lr"}
    assert surface.naming("trainer.lr", texts) == [tmp_path / "a"]


def test_the_real_config_is_surveyed(surface):
    rows = {r.key: r for r in surface.survey()}
    assert "trainer.lr" in rows and "objective.beta" in rows and "objective.is_cap" in rows
    assert "experiment/mopd.yaml" in rows["trainer.loss_weight_by_source"].recipes
    assert "trainer/smoke.yaml" in rows["trainer.total_steps"].recipes
    assert rows["trainer.total_steps"].user_facing
