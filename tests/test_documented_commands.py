"""Every `python -m miniverl.main` command in README.md's and docs/*.md's code blocks, and every inline override in
README.md's prose, composes as written (issue 38).

"Composes" is everything main does before it loads a model or starts Ray: its `__main__` block
(setup/argv.py's checked_command_line, check_objective_overrides), Hydra's composition with conf/, a resumed
run's config (continue_saved_run), to_config, and validate (the first check of prepare_run). No Ray, no training.
A resume command composes as a fresh start here (its directory holds no run); resuming is tests/test_main.py's.
Nothing is skipped silently: text that names no one config is in NOT_COMPOSED with the reason, and a command that
fails as written is a strict xfail in FAILS_AS_WRITTEN, with the error, until the docs or the code change.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from miniverl.config import MiniVerlConfig, to_config, validate
from miniverl.errors import ConfigError
from miniverl.main import CONF, check_objective_overrides, continue_saved_run
from miniverl.setup.argv import checked_command_line, home_expanded

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
ENTRY = ["python", "-m", "miniverl.main"]
SHELL_OPERATORS = {"&&", "||", "|", ";"}  # where a command ends (`pip install ... && python -m ...`)
# The entry point where a shell command starts: at the line's start or after an operator, never mid-sentence.
COMMAND_START = re.compile(r"(?:^|&&|\|\||;|\|)\s*(python -m miniverl\.main)(?:\s|$)")
FENCE = "```"
INLINE_CODE = re.compile(r"`([^`]+)`")
CONFIG_ROOTS = {f.name for f in dataclasses.fields(MiniVerlConfig)}  # data, model, rollout, objective, ...

# Floors: a broken extractor finds nothing and every parametrized test would pass on an empty list.
MIN_COMMANDS = 12  # 14 in README.md when this was written (docs/*.md: none)
MIN_INLINE_OVERRIDES = 30  # 39 distinct ones in README.md's prose when this was written

# Inline overrides are composed on top of this experiment, unless they name their own.
BASE_EXPERIMENT = "+experiment=gkd"
# Inline overrides that are valid on one experiment only (documented text -> the experiment it is composed on).
EXPERIMENT_OF = {
    # sort is a data source of mopd's reverse+sort task; gkd's reverse task has none (validate refuses the key).
    "trainer.loss_weight_by_source={sort: 4}": "+experiment=mopd",
    # the chat task and its demonstrations need an instruct model (validate refuses the built-in character models)
    "data.task=addition_chat": "+experiment=smollm2_addition",
    "data.teacher_demonstrations=4": "+experiment=smollm2_addition",
    "data.teacher_demonstrations=0": "+experiment=smollm2_addition",
}
# Recipes for the user's data: their data.train_files is a placeholder that validate refuses by design, so they are
# composed with the user's prompt file (below) after them.
USER_DATA_RECIPES = {"+experiment=gkd_4080", "+experiment=gkd_4080_12g", "+experiment=gkd_4080_7b"}
USER_DATA = "data.train_files=[prompts.jsonl]"
# Inline overrides whose value stands for the user's number (documented text -> the text composed).
PLACEHOLDER_VALUES = {
    "data.max_unencodable_rows=N": "data.max_unencodable_rows=3",
    "resources.gpus=N": "resources.gpus=2",
    "resources.scorer_gpus=M": "resources.scorer_gpus=1",
}
# The user's prompt files that the commands name: validate checks that they exist (reading them is prepare's job),
# so each is created, empty, in the working directory or the home directory the commands run in. Model paths
# (DIR, /models/...) are not created: nothing before prepare reads them.
USER_FILES = ("prompts.jsonl", "mix.parquet", "~/data/gsm8k/train.parquet", "~/data/gsm8k/test.parquet")
# Documented commands that fail as written, until the lead decides whether the docs or the command line change
# (text -> the failure). An entry fixed in the docs leaves them (test_every_table_entry_is_still_in_the_docs); one
# fixed in the code passes (strict xfail): either way the entry goes.
FAILS_AS_WRITTEN: dict[str, str] = {}  # none today: the README's `~` paths are expanded as a shell would
# Documented text that names no one command or config (text -> why it is not composed).
NOT_COMPOSED = {
    "+experiment=...": "a placeholder for any experiment (the README's experiment table lists them)",
    "rollout=...": "a placeholder for any rollout option",
    "model.student.path=...": "a placeholder for a model directory or hub id",
    "model.<role>.quantization=none|nf4": "a pattern over roles and values (model.teacher.quantization=nf4 is"
    " composed as written elsewhere in the README)",
}


@dataclasses.dataclass(frozen=True)
class Documented:
    where: str  # file:line
    text: str  # the command's arguments or the inline override, as the docs write them (shell quotes undone)
    argv: tuple[str, ...]  # what `python -m miniverl.main` receives


def fenced(lines: list[str]) -> list[bool]:
    """Whether each line lies inside a fenced code block (the fence lines themselves count as inside)."""
    inside, out = False, []
    for line in lines:
        fence = line.lstrip().startswith(FENCE)
        out.append(inside or fence)
        inside ^= fence
    return out


def documented_commands() -> list[Documented]:
    """Every command of DOCS (commands_in)."""
    return [c for name in DOCS for c in commands_in(name, (ROOT / name).read_text())]


def commands_in(name: str, markdown: str) -> list[Documented]:
    """Every `python -m miniverl.main ...` that starts a shell command in a fenced block of `markdown`, lines
    ending in a backslash joined with the next, `# comments` dropped; a mention in prose is not a command."""
    lines = markdown.splitlines()
    in_block = fenced(lines)
    found, i = [], 0
    while i < len(lines):
        start, text = i, lines[i]
        while in_block[i] and text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        command = COMMAND_START.search(text) if in_block[start] else None
        if command is None:  # prose, or a mention inside a block that is no shell line (the file tree)
            continue
        try:
            tokens = shlex.split(text[command.start(1) :], comments=True)
        except ValueError as e:  # a command the shell cannot read either: a failure naming it, not a skip
            raise ValueError(f"{name}:{start + 1}: {e}: {text}") from None
        argv = []
        for token in tokens[len(ENTRY) :]:
            if token in SHELL_OPERATORS:
                break
            argv.append(token)
        found.append(Documented(f"{name}:{start + 1}", " ".join(argv), tuple(argv)))
    return found


def config_override(token: str) -> bool:
    """`key=value`, `+key=value` or `++key=value` whose key is in the config, or `+experiment=...`."""
    if "=" not in token:
        return False
    key = token.split("=", 1)[0]
    if key == "+experiment":
        return True
    return key.lstrip("+").split(".", 1)[0] in CONFIG_ROOTS


def inline_overrides() -> list[Documented]:
    """Every distinct backticked `key=value` (or several, space-separated) in README.md's prose, on a config key;
    each is composed once, named by its first line. Composed on BASE_EXPERIMENT unless it names an experiment."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    prose = "\n".join("" if inside else line for line, inside in zip(lines, fenced(lines), strict=True))
    found: dict[str, Documented] = {}
    for match in INLINE_CODE.finditer(prose):
        try:
            tokens = whole_values(shlex.split(match.group(1).replace("\n", " ")))
        except ValueError:  # an unbalanced quote: prose, not an override
            continue
        written = " ".join(tokens)
        if not tokens or not all(config_override(t) for t in tokens) or written in found:
            continue
        composed = shlex.split(PLACEHOLDER_VALUES[written]) if written in PLACEHOLDER_VALUES else list(tokens)
        if not any(t.startswith("+experiment=") for t in tokens):
            composed.insert(0, EXPERIMENT_OF.get(written, BASE_EXPERIMENT))
        if written in USER_DATA_RECIPES:
            composed.append(USER_DATA)
        where = f"README.md:{prose.count(chr(10), 0, match.start()) + 1}"
        found[written] = Documented(where, written, tuple(composed))
    return list(found.values())


def whole_values(tokens: list[str]) -> list[str]:
    """Words rejoined where a value's bracket spans a space: prose writes `key={sort: 4}` for one override (in a
    shell it needs quotes, as `'+reward.by_source={my/set: boxed}'` has)."""
    out: list[str] = []
    for token in tokens:
        if out and sum(out[-1].count(c) for c in "[{(") > sum(out[-1].count(c) for c in "]})"):
            out[-1] += " " + token
        else:
            out.append(token)
    return out


COMMANDS = documented_commands()
INLINE = inline_overrides()


def compose_as_main(argv: tuple[str, ...]) -> MiniVerlConfig:
    """The config `python -m miniverl.main *argv` trains under, built by main's own steps up to its first check
    of the run (validate). Raises what main would answer with (ConfigError, Hydra's and OmegaConf's errors)."""
    default_run_dir = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["hydra"]["run"]["dir"]
    checked = checked_command_line(list(argv), default_run_dir)
    check_objective_overrides(checked)
    overrides = hydra_overrides(tuple(checked))
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    run_dir, task_overrides = Path(cfg.hydra.run.dir), list(cfg.hydra.overrides.task)
    with open_dict(cfg):
        del cfg["hydra"]  # as Hydra hands the config to main
    config = to_config(continue_saved_run(cfg, run_dir, task_overrides, log=lambda *_: None))
    validate(config)
    return config


@pytest.fixture
def users_machine(tmp_path, monkeypatch):
    """A working directory and a home directory holding the user's files the documented commands name."""
    home, cwd = tmp_path / "home", tmp_path / "work"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    for name in USER_FILES:
        path = Path(name).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


def hydra_overrides(argv: tuple[str, ...]) -> list[str]:
    """argv less Hydra's flags (--cfg job, --multirun), as @hydra.main reads it."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_known_args(list(argv))[0].overrides


def holds(got, value) -> bool:
    """Whether the config's `got` holds the override's `value` (a dict: every key it names, the rest defaults)."""
    if isinstance(value, dict):
        return isinstance(got, dict) and all(k in got and holds(got[k], v) for k, v in value.items())
    return got == value


def assert_set(config: MiniVerlConfig, argv: tuple[str, ...]) -> None:
    """Each `key=value` of argv on a config key reads back from the config as Hydra parses its value (a file
    key's single path as a one-element list, as DataConfig normalizes it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    node = OmegaConf.structured(config)
    expanded = tuple(home_expanded(arg) for arg in argv)  # as main reads them: `~` paths written out
    for override in OverridesParser.create().parse_overrides(hydra_overrides(expanded)):
        key = override.key_or_group
        if override.is_delete() or "." not in key or key.split(".")[0] not in CONFIG_ROOTS:
            continue  # a group choice (rollout=vllm), +experiment=..., hydra.run.dir
        value, got = override.value(), OmegaConf.select(node, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        if isinstance(got, list) and not isinstance(value, list):
            value = [value]
        assert holds(got, value), f"{override.input_line}: the config holds {got!r}"


def cases(found: list[Documented]) -> list:
    """pytest params named file:line and text; NOT_COMPOSED left out, FAILS_AS_WRITTEN as strict xfails."""
    params = []
    for case in found:
        if case.text in NOT_COMPOSED:
            continue
        failure = FAILS_AS_WRITTEN.get(case.text)
        marks = [pytest.mark.xfail(strict=True, raises=ConfigError, reason=failure)] if failure else []
        params.append(pytest.param(case, id=f"{case.where} {case.text}", marks=marks))
    return params


@pytest.mark.parametrize("command", cases(COMMANDS))
@pytest.mark.usefixtures("users_machine")
def test_a_documented_command_composes_as_written(command):
    assert_set(compose_as_main(command.argv), command.argv)


@pytest.mark.parametrize("override", cases(INLINE))
@pytest.mark.usefixtures("users_machine")
def test_an_inline_override_in_the_readme_composes(override):
    assert_set(compose_as_main(override.argv), override.argv)


def test_the_extractor_reads_a_block_as_the_shell_does():
    markdown = "\n".join(
        [
            "Run `python -m miniverl.main trainer.lr=1` in prose: a mention.",
            "```bash",
            "pip install -e . && python -m miniverl.main +experiment=gkd   # install, then run",
            "python -m miniverl.main +experiment=gkd \\",
            "  'model.teachers={a: {path: p}}' trainer.lr=1e-3 | tee log",
            "```",
            "```",
            "  main.py   the entry point: python -m miniverl.main +experiment=gkd (Hydra; a resume's",
            "```",
        ]
    )
    found = commands_in("x.md", markdown)
    assert [(c.where, c.argv) for c in found] == [
        ("x.md:3", ("+experiment=gkd",)),
        ("x.md:4", ("+experiment=gkd", "model.teachers={a: {path: p}}", "trainer.lr=1e-3")),
    ]


def test_the_extractor_finds_the_documented_commands():
    """A floor, so that a broken extractor cannot pass by finding nothing to compose."""
    assert len(COMMANDS) >= MIN_COMMANDS, [c.where for c in COMMANDS]
    assert len(INLINE) >= MIN_INLINE_OVERRIDES, [c.text for c in INLINE]
    # The README's first command over two lines is one command.
    assert any("+experiment=gkd_qwen_gsm8k" in c.text and "data.val_files=" in c.text for c in COMMANDS)


def test_every_table_entry_is_still_in_the_docs():
    """The tables above describe the docs as they are: an entry the docs no longer hold is removed with them."""
    commands = {c.text for c in COMMANDS}
    inline = {c.text for c in INLINE}
    for text in NOT_COMPOSED:
        assert text in commands | inline, f"NOT_COMPOSED: {text!r} is no longer in the docs"
    for text in FAILS_AS_WRITTEN:
        assert text in commands, f"FAILS_AS_WRITTEN: {text!r} is no longer a command in the docs"
    for table in (EXPERIMENT_OF, PLACEHOLDER_VALUES, USER_DATA_RECIPES):
        for text in table:
            assert text in inline, f"{text!r} is no longer an inline override in README.md"
    for name in USER_FILES:
        assert any(name in c.text for c in COMMANDS), f"USER_FILES: no documented command names {name}"
