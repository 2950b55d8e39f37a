"""Fail closed: every reason verl 0.9 cannot reproduce a run, collected before anything is written.

`refusal_reasons` runs every check in miniverl/bridge/checks.py, so a refused export lists everything to
change at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from miniverl.bridge.checks import CHECKS
from miniverl.bridge.spec import RunSpec
from miniverl.errors import ConfigError

__all__ = ["CHECKS", "Reason", "RunSpec", "VerlRefusal", "refusal_reasons", "refuse_unless_expressible"]


@dataclass(frozen=True)
class Reason:
    code: str  # stable name of the check (one test each)
    message: str


class VerlRefusal(ConfigError):
    """verl 0.9 cannot reproduce the run; `reasons` lists every cause and its fix."""

    def __init__(self, reasons: list[Reason]) -> None:
        self.reasons = reasons
        lines = "\n".join(f"  - [{r.code}] {r.message}" for r in reasons)
        count = f"{len(reasons)} reason{'' if len(reasons) == 1 else 's'}"
        super().__init__(f"verl cannot reproduce this run ({count}); nothing was written:\n{lines}")


def refusal_reasons(spec: RunSpec) -> list[Reason]:
    """Every reason verl cannot reproduce `spec`, in check order (empty: it can)."""
    out = []
    for check in CHECKS:
        msg = check(spec)
        if msg is not None:
            out.append(Reason(check.__name__.lstrip("_"), msg))
    return out


def refuse_unless_expressible(spec: RunSpec) -> None:
    reasons = refusal_reasons(spec)
    if reasons:
        raise VerlRefusal(reasons)
