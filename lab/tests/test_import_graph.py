"""The package's import graph (lab/import_graph.py): no circle at import, and no module that imports a
large part of the package (issue 16: run.py imported 33 of the 91 other modules and was a second controller)."""

from __future__ import annotations

from tests.scripts_loader import load_script

# A module that imports a quarter of the package is where every setting and every phase meet: the old
# run.py imported 36% of the others (33 of 91); main, the composition root of the new layout, imports
# 19%, the next (setup/prepare.py, cluster/launch.py) 15% and 13%.
MAX_FAN_OUT_FRACTION = 0.25


def graph_module():
    return load_script("lab/import_graph.py")


def test_no_import_cycle_at_module_level():
    g = graph_module()
    assert g.cycles(g.build_graph()) == []


def test_config_is_in_no_cycle_even_through_lazy_imports():
    """The circle config <-> rollout/vllm_settings.py (and setup/teachers.py) was closed by imports inside
    functions, which hid it from Python but not from a reader."""
    g = graph_module()
    modules = g.build_graph()
    assert "miniverl.config.checks" in modules  # a package of sections: each of its modules counts
    tied = [c for c in g.cycles(modules, lazy=True) if any(m.split(".")[:2] == ["miniverl", "config"] for m in c)]
    assert tied == []


def test_no_module_imports_a_large_part_of_the_package():
    g = graph_module()
    modules = g.build_graph()
    others = len(modules) - 1
    wide = {m.name: len(m.imports) for m in modules.values() if len(m.imports) > MAX_FAN_OUT_FRACTION * others}
    assert wide == {}, f"fan-out above {MAX_FAN_OUT_FRACTION:.0%} of {others} modules: {wide}"


def test_the_checks_catch_a_cycle_and_a_hub(tmp_path):
    """The same functions on a made-up package: a module-level circle and a module importing all others."""
    g = graph_module()
    root = tmp_path / "miniverl"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from miniverl.b import x\n")
    (root / "b.py").write_text("import miniverl.a\nx = 1\n")
    (root / "c.py").write_text("def f():\n    from miniverl import d\n")
    (root / "d.py").write_text("from miniverl.c import f\n")
    (root / "hub.py").write_text("from miniverl import a, b, c, d\n")
    modules = g.build_graph(root)
    assert g.cycles(modules) == [["miniverl.a", "miniverl.b"]]
    assert g.cycles(modules, lazy=True) == [["miniverl.a", "miniverl.b"], ["miniverl.c", "miniverl.d"]]
    assert modules["miniverl.hub"].imports == {"miniverl.a", "miniverl.b", "miniverl.c", "miniverl.d"}
    assert g.fan_in(modules)["miniverl.a"] == 2


# Packages that sit below the step: what they compute is read by step/ and cluster/, never the other way round at
# import. The probe's helpers (served_policy.py) lived in step/ and pulled every rollout backend and the learner up
# into it; they are a leaf of the package root now (issue 36).
BELOW_THE_STEP = ("miniverl.rollout", "miniverl.models", "miniverl.objectives", "miniverl.data", "miniverl.rewards")
ABOVE_THEM = ("miniverl.step", "miniverl.cluster", "miniverl.observe", "miniverl.main")


def upward_imports(modules, below=BELOW_THE_STEP, above=ABOVE_THEM, lazy=False) -> list[str]:
    """Imports from a package in `below` to one in `above` ('a -> b'): module-level ones, or with `lazy` those inside
    functions too."""

    def under(name: str, packages: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in packages)

    return sorted(
        f"{m.name} -> {t}" for m in modules.values() if under(m.name, below)
        for t in (m.imports if lazy else m.eager) if under(t, above)
    )  # fmt: skip


def test_nothing_below_the_step_imports_the_step_or_above_it():
    g = graph_module()
    assert upward_imports(g.build_graph()) == []


# The config and what computes (rollout backends, models, objectives, data, rewards) sit below the actors and the
# driver's setup, even through imports inside functions: the routing of several teachers (routing.py), the actor
# process's settings and CUDA lock (process.py) and the seed scheme (seeds.py) were leaves living in setup/,
# workers/ and step/, imported up from config/ and rollout/ (issue 36).
BELOW_THE_ACTORS = (*BELOW_THE_STEP, "miniverl.config")
THE_ACTORS_AND_UP = (*ABOVE_THEM, "miniverl.workers", "miniverl.setup", "miniverl.bridge")


def lazy_upward_imports(modules) -> list[str]:
    """Any import, inside a function too, from config/ or a package below the step to the actors or above."""
    return upward_imports(modules, BELOW_THE_ACTORS, THE_ACTORS_AND_UP, lazy=True)


def test_nothing_below_the_actors_imports_them_or_the_setup_even_lazily():
    g = graph_module()
    assert lazy_upward_imports(g.build_graph()) == []


def made_up_package(tmp_path, *packages: str):
    """A package `miniverl` under tmp_path with the empty subpackages `packages`; returns its root."""
    root = tmp_path / "miniverl"
    for package in packages:
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    return root


def test_the_layer_check_catches_an_upward_import(tmp_path):
    g = graph_module()
    root = made_up_package(tmp_path, "rollout", "step")
    (root / "step" / "probe.py").write_text("x = 1\n")
    (root / "rollout" / "engine.py").write_text("from miniverl.step.probe import x\n")
    (root / "rollout" / "lazy.py").write_text("def f():\n    from miniverl.step import probe\n")
    assert upward_imports(g.build_graph(root)) == ["miniverl.rollout.engine -> miniverl.step.probe"]


def test_the_lazy_layer_check_catches_an_import_inside_a_function(tmp_path):
    g = graph_module()
    root = made_up_package(tmp_path, "config", "setup")
    (root / "setup" / "teachers.py").write_text("x = 1\n")
    (root / "config" / "model.py").write_text("def check():\n    from miniverl.setup.teachers import x\n")
    assert lazy_upward_imports(g.build_graph(root)) == ["miniverl.config.model -> miniverl.setup.teachers"]


def test_floors_stand_on_what_a_module_imports_and_a_circle_shares_one(tmp_path):
    """lab/cfg_walk.py's floors: 1 + the highest floor imported; through a re-export, the defining module's."""
    g = graph_module()
    root = tmp_path / "miniverl"
    root.mkdir()
    (root / "__init__.py").write_text("from miniverl.leaf import x\n")  # only re-exports
    (root / "leaf.py").write_text("x = 1\n")
    (root / "a.py").write_text("from miniverl.b import y\n")
    (root / "b.py").write_text("def y():\n    from miniverl import a, x\n")  # a lazy circle with a
    (root / "top.py").write_text("from miniverl import x\nfrom miniverl.a import y\n")
    floors = g.floors(g.build_graph(root, through_reexports=True))
    assert floors == {"miniverl": 2, "miniverl.leaf": 1, "miniverl.a": 2, "miniverl.b": 2, "miniverl.top": 3}
    # counted as imports of the package: `from miniverl import x` stands above its __init__, which stands on leaf
    assert g.floors(g.build_graph(root)) == {**floors, "miniverl.a": 3, "miniverl.b": 3, "miniverl.top": 4}


def rooms_of(g, modules):
    """The package as its rooms: each folder under miniverl/, and each module of the package root, with the rooms it
    imports (imports inside functions too). A room that imports one which imports it back has an import running up
    the floors: the two cannot stand one above the other."""

    def room(name: str) -> str:
        return ".".join(name.split(".")[:2])

    rooms = {room(m.name): g.Module(room(m.name), m.path) for m in modules.values()}
    for m in modules.values():
        rooms[room(m.name)].imports |= {room(t) for t in m.imports} - {room(m.name)}
    return rooms


def test_the_package_folders_stand_in_floors_even_through_lazy_imports():
    """The last imports that ran back up (issue 75): the run's summary in observe/ read the setup's record, the
    step's evaluation and the cluster's actor calls (it is step/evaluation.py's run_summary now); cluster/launch.py
    read the setup's record while setup/ read cluster/placement.py (the placement plan is setup/placement.py now);
    config/rollout.py checked rollout.backend against miniverl.rollout's registry (which config/rollout.py holds
    now)."""
    g = graph_module()
    assert g.cycles(rooms_of(g, g.build_graph()), lazy=True) == []


def test_the_floor_check_catches_two_folders_importing_each_other(tmp_path):
    g = graph_module()
    root = made_up_package(tmp_path, "config", "rollout")
    (root / "rollout" / "engine.py").write_text("from miniverl.config.section import x\n")
    (root / "config" / "section.py").write_text("x = 1\ndef check():\n    from miniverl.rollout import engine\n")
    assert g.cycles(rooms_of(g, g.build_graph(root)), lazy=True) == [["miniverl.config", "miniverl.rollout"]]
