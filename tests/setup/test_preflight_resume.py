"""Issue 38: resume moves unusable checkpoints newer than the one it continues out of the run's way, before Ray,
saying so in one line; a refused resume moves nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from miniverl.checkpoints.files import CheckpointError
from miniverl.checkpoints.store import list_checkpoints, newest_valid, step_dir
from miniverl.errors import ConfigError
from miniverl.setup.preflight import resolve_resume
from tests.checkpoints.test_store import flip_a_byte, real_checkpoint
from tests.test_config import load

CADENCE = ("trainer.save_every=2", "trainer.total_steps=10")
SAVED = dataclasses.asdict(load(*CADENCE))  # the config the checkpoints were written under


def run_with(tmp_path: Path, steps: tuple[int, ...], corrupt: tuple[int, ...]) -> None:
    """Checkpoints at `steps` on the save cadence, with a byte flipped in the optimizer state of `corrupt`."""
    for step in steps:
        real_checkpoint(tmp_path, step, SAVED)
    for step in corrupt:
        flip_a_byte(step_dir(tmp_path, step) / "optimizer.pt")


def resume(tmp_path: Path, how: str, *overrides: str):
    """resolve_resume under trainer.resume=`how`; returns (ResumePoint, the lines that say a folder moved)."""
    cfg = load(*CADENCE, f"trainer.resume={how}", *overrides)
    logged = []
    point = resolve_resume(cfg, tmp_path, dataclasses.asdict(cfg), logged.append)
    return point, [line for line in logged if "aside" in line]


def aside_names(tmp_path: Path) -> list[str]:
    """The folders set aside in the run's checkpoints folder."""
    return sorted(p.name for p in (tmp_path / "checkpoints").glob("*.corrupt*"))


def test_auto_moves_a_corrupt_newest_checkpoint_aside_so_the_resumed_run_saves_its_step_again(tmp_path):
    run_with(tmp_path, (2, 4, 6), corrupt=(6,))
    point, moved = resume(tmp_path, "auto")
    assert point.path == step_dir(tmp_path, 4) and point.step == 4
    aside = tmp_path / "checkpoints" / "step_00000006.corrupt"
    assert moved == [
        f"[miniverl] moved the unusable checkpoint step_00000006 aside to {aside} (checkpoint {step_dir(tmp_path, 6)}"
        " is corrupt: optimizer.pt does not match the SHA-256 recorded when it was written), out of the way of the"
        " run continuing from step_00000004; the folder is kept for you to inspect or delete"
    ]
    assert (aside / "state.json").is_file() and list_checkpoints(tmp_path) == [step_dir(tmp_path, s) for s in (2, 4)]
    real_checkpoint(tmp_path, 6, SAVED)  # before: "step_00000006 already exists; refusing to overwrite it"
    assert newest_valid(tmp_path) == step_dir(tmp_path, 6)


def test_a_second_resume_moves_nothing_and_a_later_corrupt_copy_gets_a_name_of_its_own(tmp_path):
    run_with(tmp_path, (2, 4, 6, 8), corrupt=(6, 8))
    both = ["step_00000006.corrupt", "step_00000008.corrupt"]
    point, moved = resume(tmp_path, "auto")
    assert point.step == 4 and len(moved) == 2 and aside_names(tmp_path) == both
    point, moved = resume(tmp_path, "auto")  # the run stopped again before its next save
    assert point.step == 4 and moved == [] and aside_names(tmp_path) == both
    run_with(tmp_path, (6,), corrupt=(6,))  # it saved step 6, which broke as well
    point, moved = resume(tmp_path, "auto")
    assert point.step == 4 and len(moved) == 1 and "aside to " in moved[0] and "step_00000006.corrupt.2 (" in moved[0]
    assert aside_names(tmp_path) == ["step_00000006.corrupt", "step_00000006.corrupt.2", "step_00000008.corrupt"]


def test_an_explicit_older_checkpoint_moves_corrupt_newer_ones_and_still_refuses_valid_newer_ones(tmp_path):
    run_with(tmp_path, (2, 4, 6), corrupt=(6,))
    point, moved = resume(tmp_path, str(step_dir(tmp_path, 4)))
    assert point.step == 4 and "step_00000006 aside" in moved[0] and aside_names(tmp_path) == ["step_00000006.corrupt"]
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 2), step_dir(tmp_path, 4)]
    # A valid newer checkpoint is the run's own work: refused as before, and the corrupt one beside it stays put.
    run_with(tmp_path, (6, 8), corrupt=(6,))
    with pytest.raises(ConfigError, match="is older than step_00000008 in the same run"):
        resume(tmp_path, str(step_dir(tmp_path, 4)))
    assert step_dir(tmp_path, 6).is_dir() and aside_names(tmp_path) == ["step_00000006.corrupt"]


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (("model.lora.rank=4",), "another LoRA shape"),
        (("trainer.total_steps=4",), "already finished step 4 of trainer.total_steps=4"),
    ],
)
def test_a_refused_resume_moves_nothing(tmp_path, overrides, refusal):
    run_with(tmp_path, (2, 4, 6), corrupt=(6,))
    with pytest.raises(ConfigError, match=refusal):
        resume(tmp_path, "auto", *overrides)
    assert step_dir(tmp_path, 6).is_dir() and aside_names(tmp_path) == []


def test_auto_with_every_checkpoint_corrupt_is_refused_and_moves_nothing(tmp_path):
    run_with(tmp_path, (2, 4), corrupt=(2, 4))
    with pytest.raises(ConfigError, match=r"no usable checkpoint \(2 found, none valid\)"):
        resume(tmp_path, "auto")
    assert len(list_checkpoints(tmp_path)) == 2 and aside_names(tmp_path) == []


def test_a_corrupt_checkpoint_in_a_read_only_run_directory_stops_the_resume_in_one_line(tmp_path, monkeypatch):
    import errno

    run_with(tmp_path, (2, 4, 6), corrupt=(6,))

    def read_only(*_args):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "rename", read_only)
    with pytest.raises(CheckpointError, match=r"could not move the unusable checkpoint .*step_00000006 aside") as info:
        resume(tmp_path, "auto")
    assert "\n" not in str(info.value) and f"make {tmp_path / 'checkpoints'} writable" in str(info.value)
    assert step_dir(tmp_path, 6).is_dir() and aside_names(tmp_path) == []
