"""The config a resumed run continues under: its checkpoint's saved config read under the schema of the run that wrote
it, with the keys the resume command sets (issue 76). Apart from checkpoints/compat.py, which the setup's checks import:
this reads the config's schema, and only main, above both, needs it."""

from __future__ import annotations

import dataclasses
from typing import Any

from miniverl.checkpoints.compat import flatten
from miniverl.errors import ConfigError


def resumed_config(current, saved: dict[str, Any], keys: list[str]):
    """The config a resumed run continues under: the saved run's, with the keys set now (`keys`) taken from
    `current` (the composed DictConfig of this command). Returns (config, keys that differ from `current`
    only because the saved value was kept).

    The saved config is read under the schema of the run that wrote it (issue 76): its own objective's dataclass,
    not the one the resume command's composition chose (the default objective, gkd, when `+experiment=pg_k1` is not
    repeated), and dicts of dataclasses (model.teachers) taking the saved entries as they are. A key the saved
    run's schema lacks (objective.beta set on resuming a pg_k1 run) is refused naming it.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from miniverl.config.objective import OBJECTIVE_CONFIGS
    from miniverl.config.schema import structured_schema

    objective = saved.get("objective", {}).get("name")
    if objective not in OBJECTIVE_CONFIGS:
        raise ConfigError(
            f"the checkpoint's run trained objective {objective!r}, which this miniverl does not have (it has"
            f" {', '.join(OBJECTIVE_CONFIGS)}); resume it with the miniverl version that wrote it, or start a fresh run"
        )
    try:
        merged = OmegaConf.merge(structured_schema(objective), saved)  # the saved run's schema, types and values
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"the checkpoint's saved config does not fit this miniverl's schema ({e.__class__.__name__}:"
            f" {str(e).splitlines()[0]}); resume it with the miniverl version that wrote it, or start a fresh run"
        ) from e
    for key in keys:
        try:
            OmegaConf.update(merged, key, OmegaConf.select(current, key), merge=False)
        except OmegaConfBaseException:
            owned = [f.name for f in dataclasses.fields(OBJECTIVE_CONFIGS[objective])]
            where = f"the resumed run's objective {objective} (its settings: {', '.join(owned)})"
            raise ConfigError(
                f"{key} is not a setting of {where if key.startswith('objective.') else 'the resumed config'}; a"
                f" resumed run trains what its checkpoint trained. Fix: drop {key} from the resume command"
            ) from None
    OmegaConf.set_struct(merged, True)  # as Hydra hands a config over: a later typo is refused, not added
    now = flatten(OmegaConf.to_container(current, resolve=True))
    kept = flatten(OmegaConf.to_container(merged, resolve=True))
    set_now = tuple(keys) + tuple(f"{k}." for k in keys)
    differ = sorted(k for k in now if now[k] != kept.get(k) and not k.startswith(set_now))
    return merged, differ
