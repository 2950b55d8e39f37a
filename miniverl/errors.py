"""The errors miniverl raises on purpose; each message names the problem and its fix."""

from __future__ import annotations


class MiniVerlError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""


class ConfigError(MiniVerlError):
    """The configuration (or what it points at) cannot work."""


class BatchError(MiniVerlError, ValueError):
    """A batch violates its contract (shape, dtype or mask)."""


class PolicyMismatchError(MiniVerlError):
    """Strict sync was violated: data or an engine does not match the published policy."""


class NonFiniteError(MiniVerlError):
    """A NaN or inf loss, gradient or weight; nothing poisoned was applied, published or saved."""
