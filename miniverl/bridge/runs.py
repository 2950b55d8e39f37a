"""A finished or planned run as the bridge reads it: a run directory's .hydra/config.yaml or a composed
config YAML, typed by miniverl/config/ and validated, plus keys a newer schema may carry."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from miniverl.bridge.data import prompt_rows
from miniverl.bridge.spec import RunSpec
from miniverl.bridge.versions import DEFAULT_VERL_VERSION
from miniverl.config import MiniVerlConfig, structured_schema, to_config, validate
from miniverl.errors import ConfigError
from miniverl.models.builtin import BuiltinRecipe, builtin_dir, parse_builtin_ref

RUN_CONFIG = Path(".hydra") / "config.yaml"
PROBE_TEXT = "abc"  # any text the tokenizer encodes without special tokens of its own
# Settings the refusals must see even when this miniVERL's schema lacks them (a run written by a newer
# one): taken out of the raw YAML before typing, or read from the typed config once the schema has them.
# (reward.* is in the schema: the checks read cfg.reward.)
FORWARD_KEYS = {"quantization": ("model", "student", "quantization")}


def load_run(source: str | Path, verl_version: str = DEFAULT_VERL_VERSION) -> RunSpec:
    """The run at `source` (a run directory or a config YAML) as a RunSpec for the refusals and translation."""
    import yaml

    path = Path(source)
    file = path / RUN_CONFIG if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"{source}: neither a run directory with {RUN_CONFIG} nor a config file; pass outputs/<date>/<time>"
            " or a YAML written by `python -m miniverl.main ... --cfg job`"
        )
    raw = yaml.safe_load(file.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a mapping of config groups, got {type(raw).__name__}")
    forward = {name: _take(raw, keys) for name, keys in FORWARD_KEYS.items() if not _schema_has(keys)}
    cfg = _typed(raw, file)
    for name, keys in FORWARD_KEYS.items():
        if _schema_has(keys):
            forward[name] = _select(cfg, keys)
    # The rollout backend is judged against verl's engines (refusals) whether or not this miniVERL has it
    # registered, so validation runs every other check with a known backend in its place.
    validate(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend="hf_reference")))
    student, _ = model_paths(cfg)
    tok = student_tokenizer(student)
    has_template = None if tok is None else bool(getattr(tok, "chat_template", None))
    # The run's own prompt stream needs a tokenizer that can render it; otherwise the files' rows are read
    # as they are, so that the refusals (prompt_tokens) can say why.
    renders = tok is not None and (has_template or not (cfg.data.train_files and cfg.data.chat_template))
    rows = prompt_rows(cfg, tok if renders else None)
    return RunSpec(
        cfg=cfg,
        verl_version=verl_version,
        student_quantization=forward["quantization"],
        student_vocab_size=_vocab_size(student),
        prompt_special_tokens=None if tok is None else prompt_special_tokens(tok),
        student_chat_template=has_template,
        data_sources=tuple(dict.fromkeys(r["data_source"] for split in rows.values() for r in split)),
        rows=rows,
    )


def model_paths(cfg: MiniVerlConfig) -> tuple[str, str]:
    """Student and teacher as verl loads them: built-in models resolve to their cache directories."""

    def resolve(path: str) -> str:
        ref = parse_builtin_ref(path, cfg.data.task)  # builtin:<role>[/<task>]
        if ref is None:
            return path
        role, task = ref
        return str(builtin_dir(cfg.model.cache_dir, BuiltinRecipe(task, cfg.data.min_len, cfg.data.max_len)) / role)

    return resolve(cfg.model.student.path), resolve(cfg.model.teacher.path)


def _typed(raw: dict, file: Path) -> MiniVerlConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    objective = (raw.get("objective") or {}).get("name") if isinstance(raw.get("objective"), dict) else None
    try:  # the objective's own dataclass (miniverl/config/objective.py): a key another objective owns is refused
        merged = OmegaConf.merge(structured_schema(objective or MiniVerlConfig().objective.name), raw)
    except OmegaConfBaseException as e:  # an unknown key or a wrong type
        raise ConfigError(
            f"{file}: {str(e).splitlines()[0]}; the config must fit this miniVERL's schema (miniverl/config/)"
        ) from e
    return to_config(merged)


def _take(raw: dict, keys: tuple[str, ...]):
    """Remove raw[k0][k1]...; return its value (None when absent). Emptied parents are removed too."""
    parents = [raw]
    for key in keys[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return None
        parents.append(child)
    value = parents[-1].pop(keys[-1], None)
    for parent, key in zip(reversed(parents[:-1]), reversed(keys[:-1])):
        if parent[key] == {}:
            del parent[key]
    return value


def _schema_has(keys: tuple[str, ...]) -> bool:
    """Whether miniverl/config/ has the setting at `keys` (model.student.quantization, ...)."""
    import typing

    node = MiniVerlConfig
    for key in keys:
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if key not in hints:
            return False
        node = hints[key]
    return True


def _select(cfg, keys: tuple[str, ...]):
    node = cfg
    for key in keys:
        node = getattr(node, key, None)
    return node


def student_tokenizer(model_path: str):
    """The student's tokenizer when it is a local directory, else None (nothing is downloaded)."""
    path = Path(model_path).expanduser()
    if not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def prompt_special_tokens(tok) -> str:
    """What `tok` adds around a plain prompt, as miniVERL tokenizes raw prompts (`tokenizer(text)`):
    "none", "bos", or a description of anything else."""
    plain = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    full = tok(PROBE_TEXT)["input_ids"]
    if full == plain:
        return "none"
    if tok.bos_token_id is not None and full == [tok.bos_token_id, *plain]:
        return "bos"
    return f"adds {tok.convert_ids_to_tokens([t for t in full if t not in plain])} around the text"


def _vocab_size(model_path: str) -> int | None:
    file = Path(model_path).expanduser() / "config.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text()).get("vocab_size")
