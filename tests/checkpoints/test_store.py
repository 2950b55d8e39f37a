"""Checkpoints in a run directory: an unusable one set aside stays whole, out of every listing, and out of the way."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from miniverl.checkpoints.files import CheckpointError, write_checkpoint
from miniverl.checkpoints.store import list_checkpoints, newest_valid, prune, scan, set_aside, step_dir
from miniverl.policy import PolicyIdentity


class TinyAdapter:
    """Stands in for a peft model: write_checkpoint only calls save_pretrained."""

    def save_pretrained(self, directory: str) -> None:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)


class TinyOptimizer:
    """Stands in for the learner's AdamW (whose first construction imports torch._dynamo: seconds)."""

    def state_dict(self) -> dict:
        return {"state": {0: {"exp_avg": torch.arange(64.0)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]}


def real_checkpoint(run_dir: Path, step: int, config: dict | None = None) -> Path:
    """A checkpoint written the way the learner writes one (atomic, every file's SHA-256 in state.json)."""
    optimizer = TinyOptimizer()
    meta = {"step": step, "config": config or {}, "config_hash": "h", "first_eval": {"eval/accuracy": 0.5}}
    return write_checkpoint(step_dir(run_dir, step), TinyAdapter(), optimizer, PolicyIdentity(step, "d"), meta)


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_a_set_aside_checkpoint_stays_whole_is_never_listed_pruned_or_overwritten_and_its_step_saves_again(tmp_path):
    for step in (2, 4):
        real_checkpoint(tmp_path, step)
    flip_a_byte(step_dir(tmp_path, 4) / "optimizer.pt")
    path, skipped = scan(tmp_path)
    assert path == step_dir(tmp_path, 2) and [bad.path for bad in skipped] == [step_dir(tmp_path, 4)]
    assert skipped[0].error.reason.endswith("optimizer.pt does not match the SHA-256 recorded when it was written")
    before = {p.relative_to(step_dir(tmp_path, 4)): p.read_bytes() for p in step_dir(tmp_path, 4).rglob("*.*")}

    moved = set_aside(step_dir(tmp_path, 4))
    assert moved == tmp_path / "checkpoints" / "step_00000004.corrupt" and not step_dir(tmp_path, 4).exists()
    assert {p.relative_to(moved): p.read_bytes() for p in moved.rglob("*.*")} == before  # kept as it was
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 2)] and newest_valid(tmp_path) == step_dir(tmp_path, 2)
    assert real_checkpoint(tmp_path, 4) == step_dir(tmp_path, 4)  # the step the corrupt one held saves again
    assert prune(tmp_path, keep=1) == [step_dir(tmp_path, 2)] and moved.is_dir()  # the user's to delete, not prune's

    flip_a_byte(step_dir(tmp_path, 4) / "rng.pt")  # corrupt again: the first copy set aside is not replaced
    assert set_aside(step_dir(tmp_path, 4)).name == "step_00000004.corrupt.2"
    assert {p.relative_to(moved): p.read_bytes() for p in moved.rglob("*.*")} == before
    assert list_checkpoints(tmp_path) == [] and newest_valid(tmp_path) is None


@pytest.mark.parametrize(
    "error", [OSError(errno.EROFS, "Read-only file system"), PermissionError(errno.EACCES, "Permission denied")]
)
def test_a_checkpoint_that_cannot_be_moved_aside_is_named_in_one_line_with_the_fix(tmp_path, monkeypatch, error):
    real_checkpoint(tmp_path, 6)

    def fail(*_args):
        raise error

    monkeypatch.setattr(Path, "rename", fail)
    with pytest.raises(CheckpointError) as info:
        set_aside(step_dir(tmp_path, 6))
    message = str(info.value)
    assert "\n" not in message and error.strerror in message
    assert f"could not move the unusable checkpoint {step_dir(tmp_path, 6)} aside to step_00000006.corrupt" in message
    assert f"make {tmp_path / 'checkpoints'} writable, or move step_00000006 out of it yourself" in message
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 6)]  # left where it was
