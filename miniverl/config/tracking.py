"""The tracking section: wandb's mode, the run's name, progress bar and plots."""

from __future__ import annotations

from dataclasses import dataclass

from miniverl.config.base import require


@dataclass
class TrackingConfig:
    wandb_mode: str = "offline"  # offline (no account, no network) | online | disabled
    project: str = "miniverl"
    run_name: str | None = None
    progress_bar: bool = True
    plots: bool = True  # PNG curves in the run directory at the end (needs matplotlib)

    def check(self) -> None:
        require(
            self.wandb_mode in ("offline", "online", "disabled"),
            f"tracking.wandb_mode={self.wandb_mode!r}: use offline, online or disabled",
        )
