"""The command line before Hydra reads it (main's first step, before Ray): an override Hydra would answer with a
traceback or a bare "Could not override" is either rewritten into the form Hydra accepts or refused with one line
naming it and the fix. Nothing here composes the config, and nothing is left on disk (the run directory's check
makes and removes one probe directory)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miniverl.config import MiniVerlConfig
from miniverl.errors import ConfigError

RUN_DIR_KEY = "hydra.run.dir"
BRACKETS = {"[": "]", "{": "}", "(": ")"}
QUOTES = "'\""
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
LEXER_ERROR = "LexerNoViableAltException: "
QUOTING = "quote a value that holds spaces or any of []{}(),:=' (key='a b')"
# What a value-typed key holds, where a user coming from verl may write it as a section (verl's
# custom_reward_function.path and .name are one key here).
VALUE_FORMS = {"reward.custom_function": "path/to/file.py:name (verl's custom_reward_function.path and .name in one)"}
# Keys that existed once and were removed: what to set instead (a bare "not in struct" would not say).
REMOVED_KEYS = {
    "trainer.seed": "it was read by nothing. Fix: drop it; a run's randomness comes from rollout.seed (sampling),"
    " data.seed (prompt draws and shuffles) and model.lora.init_seed (the adapter's initial weights)",
}


def checked_command_line(argv: list[str], default_run_dir: str | None) -> list[str]:
    """`argv` (sys.argv[1:]) with `~` paths expanded (home_expanded) and dict-valued keys in the form Hydra accepts
    (accepted_form). Raises ConfigError for a malformed override, a removed key (REMOVED_KEYS), several values
    without --multirun, or a run directory (hydra.run.dir, else `default_run_dir`) that cannot be made; with
    `default_run_dir` None (a command that writes no run directory: `python -m miniverl.fit`) none is checked."""
    from hydra._internal.utils import get_args_parser  # the parser @hydra.main uses: flags vs overrides

    argv = [home_expanded(arg) for arg in argv]
    args = get_args_parser().parse_known_args(argv)[0]
    parsed = dict(zip(args.overrides, parse_overrides(args.overrides), strict=True))
    sweeps = [text for text, o in parsed.items() if o.is_sweep_override()]
    if sweeps and not args.multirun:
        raise ConfigError(
            f"the override '{sweeps[0]}' gives one run several values (a sweep). Fix: a list is key=[a,b], a value"
            " holding commas is quoted (key='a,b'), and a sweep of runs needs --multirun"
        )
    for text, o in parsed.items():
        leaf = value_above(o.key_or_group)
        if leaf is not None:
            key, kind = leaf
            form = VALUE_FORMS.get(key, f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}")
            raise ConfigError(
                f"the override '{text}' {'removes' if o.is_delete() else 'sets'} a key under {key}, which is one value,"
                f" not a section: {form}. Fix: {key}=<value>" + (f" (or ~{key} to remove it)" if o.is_delete() else "")
            )
        if o.key_or_group in REMOVED_KEYS:
            raise ConfigError(
                f"the override '{text}' sets {o.key_or_group}, which was removed: {REMOVED_KEYS[o.key_or_group]}"
            )
    run_dirs = [str(o.value()) for o in parsed.values() if o.key_or_group == RUN_DIR_KEY and not o.is_delete()]
    if default_run_dir is not None:
        check_run_dir(run_dirs[-1] if run_dirs else default_run_dir)
    rewritten = {text: accepted_form(text, o) for text, o in parsed.items()}
    return [rewritten.get(arg, arg) for arg in argv]


HOME_PATH = re.compile(r"(^|[\[,])~(?=[/,\]]|$)")  # a `~` that starts a path of the value (or of a list item)


def home_expanded(arg: str) -> str:
    """`key=~/x` and `key=[~/a,~/b]` with the home directory written out, as a shell does for `~/x` alone: the
    shell leaves a `~` after `key=` as it is, and Hydra's grammar refuses it unquoted. Quoted values are left."""
    key, eq, value = arg.partition("=")
    if not eq or arg.startswith("-") or value[:1] in QUOTES:
        return arg
    return key + eq + HOME_PATH.sub(lambda m: m.group(1) + os.path.expanduser("~"), value)


def parse_overrides(overrides: list[str]) -> list[Any]:
    """Hydra's reading of each override (hydra Override objects); a malformed one is a ConfigError naming it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.extend(parser.parse_overrides([text]))
        except OverrideParseException as e:
            raise ConfigError(f"cannot read the override '{text}': {what_is_malformed(text, e.message)}") from None
    return parsed


def what_is_malformed(override: str, hydra_message: str) -> str:
    """What in a refused override is wrong, in words, and the fix (Hydra's own message names neither)."""
    if "=" not in override and not override.startswith("~"):
        return "it has no '='. Fix: key=value to set a key, ~key to remove one"
    problem = unbalanced(override.split("=", 1)[1])
    if problem:
        return problem
    first, *rest = hydra_message.splitlines()
    if first.startswith(LEXER_ERROR) and rest and "^" in rest[0]:  # Hydra's caret under the character it stopped at
        at = rest[0].index("^") - len(LEXER_ERROR)
        if at < override.index("="):
            return f"its key cannot hold {override[at]!r}. Fix: a key is a dotted name (trainer.lr)"
        return f"its value cannot hold {override[at]!r} unquoted. Fix: {QUOTING}"
    return f"{first}. Fix: {QUOTING}; the grammar: {GRAMMAR}"


def unbalanced(value: str) -> str | None:
    """The first bracket or quote of an override's value that is never closed, or closes nothing, and the fix."""
    opened: list[str] = []
    quote, escaped = None, False
    quoting = "or quote a value that holds a bracket (key='a[b')"
    for ch in value:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote is not None:
            quote = None if ch == quote else quote
        elif ch in QUOTES:
            quote = ch
        elif ch in BRACKETS:
            opened.append(ch)
        elif ch in BRACKETS.values():
            if not opened:
                return f"its '{ch}' closes nothing. Fix: drop it, {quoting}"
            if BRACKETS[opened[-1]] != ch:
                return f"its '{opened[-1]}' is closed by a '{ch}'. Fix: close it with '{BRACKETS[opened[-1]]}'"
            opened.pop()
    if quote is not None:
        return f"its quote {quote} is never closed. Fix: close it (key={quote}a b{quote})"
    if opened:
        return (
            f"its '{opened[-1]}' is never closed. Fix: close it with '{BRACKETS[opened[-1]]}' (a list is key=[a,b],"
            f" a dict key={{a: 1}}), {quoting}"
        )
    return None


def schema_fields(key: str) -> Iterator[tuple[str, Any]]:
    """(the dotted key so far, its field's type hint) for each part of `key` down MiniVerlConfig's dataclasses, until
    a part that names no field or lies under a field that is not a dataclass (`str | None` counts as `str`)."""
    schema: Any = MiniVerlConfig
    parts = key.split(".")
    for i, name in enumerate(parts):
        hint = typing.get_type_hints(schema).get(name) if dataclasses.is_dataclass(schema) else None
        if hint is None:
            return
        yield ".".join(parts[: i + 1]), hint
        schema = single_type(hint)


def single_type(hint: Any) -> Any | None:
    """The one type a field's hint allows besides None (`str | None`: str; `int`: int), else None."""
    options = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) else [hint]
    return options[0] if len(options) == 1 else None


def value_above(key: str) -> tuple[str, str] | None:
    """(the key of a plain-valued field of MiniVerlConfig that `key` lies under, its type's name), or None when `key`
    is a field, lies under a section, a dict or a list, or is not in the schema (Hydra's or the objective's checks
    say so)."""
    for above, hint in schema_fields(key.rpartition(".")[0]):
        if hint is Any or typing.get_origin(hint) in (dict, list, tuple):
            return None  # a dict's keys and a list's indices (model.lora.target_modules.0=q_proj) are Hydra's
        kind = single_type(hint)
        if isinstance(kind, type) and not dataclasses.is_dataclass(kind):
            return above, kind.__name__
    return None


def dict_field(key: str) -> tuple[str, Any] | None:
    """(the dict-typed field of MiniVerlConfig that `key` is or lies under, the type of its values), or None."""
    for field, hint in schema_fields(key):
        if typing.get_origin(hint) is dict:
            return field, typing.get_args(hint)[1]
    return None


def accepted_form(text: str, override: Any) -> str:
    """The override Hydra accepts for `text` (whose parse is `override`) where `text` sets a dict-valued key
    (trainer.loss_weight_by_source, reward.by_source, model.teachers, ...); any other override as it is.

    Hydra composes the config in struct mode, where a plain `key=...` may not add a key: so
    `trainer.loss_weight_by_source={sort: 4}` worked only where the experiment already named sort (mopd), and
    `+...sort=4` only where it did not. `++` adds or changes, merging a dict into the one there as `key=` does,
    so the same command composes to the same config on every experiment. A dict of dataclasses (model.teachers)
    cannot take a new entry in place (OmegaConf refuses a plain dict as a ModelSpec) but merges one into itself:
    `+model.teachers.extra={path: p}` and `model.teachers.extra.path=p` become `++model.teachers={extra: {path: p}}`
    (a resumed run then takes all of model.teachers from this command, as with the dict form).
    """
    from hydra.core.override_parser.types import OverrideType, ValueType

    if override.value_type != ValueType.ELEMENT or override.package is not None or override.is_delete():
        return text
    found = dict_field(override.key_or_group)
    if found is None:
        return text
    field, value_type = found
    value, written = override.value(), text.split("=", 1)[1]
    rest = override.key_or_group[len(field) + 1 :].split(".") if override.key_or_group != field else []
    if not rest:  # the dict itself: `+` and `++` already add keys; a dict value merges, as Hydra's `key=` does
        return f"++{text}" if override.type == OverrideType.CHANGE and isinstance(value, dict) else text
    if dataclasses.is_dataclass(value_type):  # model.teachers.<name>[.<field>]: merged in from the dict itself
        if len(rest) == 1 and not isinstance(value, dict):
            return text
        nested, expected = written, value
        for name in reversed(rest):
            nested, expected = f"{{{name}: {nested}}}", {name: expected}
        merged = f"++{field}={nested}"
        # A name the grammar reads otherwise inside a dict (null, true) keeps the user's form and Hydra's answer.
        return merged if reads_as(merged, expected) else text
    return f"++{override.key_or_group}={written}" if len(rest) == 1 else text


def reads_as(text: str, value: Any) -> bool:
    """Whether Hydra reads the override `text` as setting `value`."""
    try:
        return parse_overrides([text])[0].value() == value
    except ConfigError:
        return False


def check_run_dir(run_dir: str) -> None:
    """hydra.run.dir is a directory, or can be made one, that this user can write. Hydra makes it before main
    runs, so a file in the way ended in a traceback. The part after a `${...}` (the default's timestamp) is not
    known yet: its literal head is checked. Raises ConfigError."""
    head = list(itertools.takewhile(lambda part: "${" not in part, Path(run_dir).parts))
    if not head:
        return
    path = Path(*head)
    first = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
    if first == Path(run_dir) and not first.is_dir():
        raise ConfigError(
            f"{RUN_DIR_KEY}={run_dir} is a file, not a directory. Fix: set {RUN_DIR_KEY} to a new directory, or"
            " to the directory of a run to continue"
        )
    if not first.is_dir():
        raise ConfigError(
            f"{RUN_DIR_KEY}={run_dir} cannot be created: {first} is a file, not a directory. Fix: set"
            f" {RUN_DIR_KEY} to a path under a directory"
        )
    made = "written" if first == Path(run_dir) else "created"
    if not os.access(first, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{RUN_DIR_KEY}={run_dir} cannot be {made}: this user may not write to {first}. Fix: set"
            f" {RUN_DIR_KEY} to a path under a directory you can write to"
        )
    try:  # permission bits are not the whole answer (root, read-only mounts, /proc): make and remove a directory
        os.rmdir(tempfile.mkdtemp(prefix=".miniverl-probe-", dir=first))
    except OSError as e:
        raise ConfigError(
            f"{RUN_DIR_KEY}={run_dir} cannot be {made}: {first} refuses a new directory ({e.strerror}). Fix: set"
            f" {RUN_DIR_KEY} to a path under a directory you can write to"
        ) from None
