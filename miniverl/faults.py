"""How a run stops on a signal or a dead actor: named, with the last checkpoint intact."""

from __future__ import annotations

import signal
import threading
from typing import Any

from miniverl.protocol import MiniVerlError

SIGNAL_EXIT_BASE = 128  # shell convention: a process ended by signal N exits with 128 + N (130 = Ctrl-C)


class RunInterrupted(MiniVerlError):
    """SIGINT/SIGTERM arrived; the last completed step was checkpointed and the actors were stopped."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = SIGNAL_EXIT_BASE + signum


class ActorDiedError(MiniVerlError):
    """An actor process died mid-run (killed, out of memory, crashed)."""


class StopRequests:
    """While active, SIGINT and SIGTERM ask the run to stop after the current step instead of killing it.

    A second signal stops at once (KeyboardInterrupt), for a step that hangs. Handlers can only be set in
    the main thread; elsewhere (a run started from a thread) signals keep their default behaviour.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.signum = signum
        print(
            f"\n[miniverl] {signal.Signals(signum).name}: finishing the current step, then checkpointing and"
            " stopping (send it again to stop at once)",
            flush=True,
        )

    @property
    def requested(self) -> bool:
        return self.signum is not None


def actor_names(actors: dict[str, list[Any]]) -> dict[str, str]:
    """Ray actor id (hex) -> 'rollout replica 0' etc., to name the actor in a RayActorError."""
    out = {}
    for role, group in actors.items():
        for i, actor in enumerate(group):
            actor_id = getattr(actor, "_actor_id", None)
            if actor_id is not None:
                out[actor_id.hex()] = f"{role} replica {i}"
    return out


def dead_actor_error(error: Exception, names: dict[str, str], step: int, checkpoint: str | None) -> ActorDiedError:
    who = names.get(getattr(error, "actor_id", None) or "", "an actor")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else error.__class__.__name__
    resume = (
        f"the last checkpoint {checkpoint} is intact; continue with trainer.resume=auto"
        if checkpoint
        else "no checkpoint was written yet (trainer.save_every sets how often); rerun from the start"
    )
    return ActorDiedError(f"the {who} actor died during step {step} ({first_line}); {resume}")
