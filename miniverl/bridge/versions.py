"""Which verl the bridge targets and which miniVERL wrote a file: both are checked, never assumed."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# Every verl key the translation writes was read in verl 0.9.1's own config (trainer/config/*.yaml and
# the config dataclasses); tests/bridge compose them with that release's Hydra config. Another release
# may rename or drop keys, so it is refused until it is checked the same way.
SUPPORTED_VERL_VERSIONS = ("0.9.1",)
DEFAULT_VERL_VERSION = "0.9.1"


def miniverl_version() -> str:
    """The installed miniverl's version (pyproject), as written into every manifest."""
    try:
        return version("miniverl")
    except PackageNotFoundError as e:  # a source tree that was never installed
        raise RuntimeError("miniverl is not installed, so its version is unknown; run `pip install -e .`") from e


def major(v: str) -> str:
    """The major component of a version string ("0.1.0" -> "0")."""
    return v.split(".", 1)[0]


def unsupported_verl_version(v: str) -> str | None:
    """The reason `v` cannot be targeted, or None when it is supported."""
    if v in SUPPORTED_VERL_VERSIONS:
        return None
    return (
        f"verl version {v!r} is not one the bridge was verified against ({', '.join(SUPPORTED_VERL_VERSIONS)});"
        f" its config keys may differ. Target --verl-version {DEFAULT_VERL_VERSION}"
    )
