"""Small name -> implementation registries, resolved lazily so `import miniverl` imports no backend."""

from __future__ import annotations

import importlib
from typing import Any

from miniverl.errors import ConfigError


class Registry:
    """Maps config names to objects or to lazy "module:attribute" paths. Registering a name twice raises."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, Any] = {}

    def register(self, name: str, target: Any) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def require(self, name: str) -> None:
        """Raise a ConfigError listing the known names when `name` is unknown; imports nothing."""
        if name not in self._entries:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())} (set {self.config_key}=<one of them>)"
            )

    def get(self, name: str) -> Any:
        self.require(name)
        target = self._entries[name]
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            target = getattr(importlib.import_module(module), attr)
            self._entries[name] = target
        return target
