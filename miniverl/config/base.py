"""The refusal every config check raises: a ConfigError whose message names the key and the fix."""

from __future__ import annotations

from miniverl.errors import ConfigError


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)
