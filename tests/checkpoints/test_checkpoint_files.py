"""Checkpoint files written by the learner: round trip, atomicity, integrity, and a poisoned adapter."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from miniverl.checkpoints import files
from miniverl.checkpoints.files import CheckpointError, read_state
from miniverl.checkpoints.store import list_checkpoints, newest_valid, prune, step_dir
from miniverl.models.lora import adapter_state
from miniverl.objectives.gkd import GkdObjective
from miniverl.workers.learner import LearnerWorker, NonFiniteError
from tests.step.test_controller import CPU, LORA, PARAMS, make_controller

META = {"config": {"model": {"lora": {"rank": 4}}}, "config_hash": "h", "first_eval": {"eval/accuracy": 0.5}}


def new_learner(student_dir, objective=None, **kwargs) -> LearnerWorker:
    objective = objective or GkdObjective(0.5, 1.0, 0)
    return LearnerWorker(str(student_dir), LORA, "float32", objective, 5e-2, 0.0, 1.0, 4, CPU, **kwargs)


@pytest.fixture()
def trained(parts, student_dir):
    """A learner after one real strict-sync step (so the adapter and AdamW state are non-trivial)."""
    from miniverl.workers.rollout import RolloutWorker

    tok, prompts, _, scorer = parts
    learner = new_learner(student_dir)
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    ctl = make_controller(rollout, (tok, prompts, learner, scorer))
    ctl.step(prompts, PARAMS)
    return learner, ctl, prompts


def test_round_trip_restores_adapter_optimizer_version_and_continues_identically(trained, student_dir, tmp_path):
    learner, ctl, prompts = trained
    path = learner.save_checkpoint(str(step_dir(tmp_path, 1)), {**META, "step": 1})
    state = read_state(step_dir(tmp_path, 1))
    assert state["step"] == 1 and state["policy_version"] == 1 and set(state["files"]) >= {"optimizer.pt", "rng.pt"}
    restored = new_learner(student_dir)
    identity = restored.load_checkpoint(path)
    assert identity.version == 1 and identity.digest == state["policy_digest"]
    for k, v in adapter_state(learner.model).items():
        assert torch.equal(adapter_state(restored.model)[k], v), k
    # One more identical step on both: same adapter bit for bit (AdamW moments were restored too).
    ctl.step(prompts, PARAMS)
    ctl.learners = [restored]
    ctl.step(prompts, PARAMS)
    a, b = adapter_state(learner.model), adapter_state(restored.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert restored.version == learner.version == 2


def test_an_existing_checkpoint_is_never_overwritten(trained, tmp_path):
    learner, _, _ = trained
    learner.save_checkpoint(str(tmp_path / "step_1"), META)
    with pytest.raises(CheckpointError, match="already exists"):
        learner.save_checkpoint(str(tmp_path / "step_1"), META)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "Permission denied"),
    ],
)
def test_disk_full_or_unwritable_keeps_the_previous_checkpoint(trained, tmp_path, monkeypatch, error):
    learner, _, _ = trained
    good = learner.save_checkpoint(str(step_dir(tmp_path, 1)), META)
    before = read_state(step_dir(tmp_path, 1))

    def fail(*_args, **_kwargs):
        error.filename = str(step_dir(tmp_path, 2)) + ".partial/optimizer.pt"
        raise error

    monkeypatch.setattr(files.torch, "save", fail)
    with pytest.raises(CheckpointError) as info:
        learner.save_checkpoint(str(step_dir(tmp_path, 2)), META)
    message = str(info.value)
    assert str(step_dir(tmp_path, 2)) in message and "previous" in message and "trainer.resume=auto" in message
    if error.errno == errno.ENOSPC:  # issue 76: named as the full disk it is
        assert message.startswith(f"the disk is full while writing {step_dir(tmp_path, 2)}; free space on it (")
    else:
        assert error.strerror in message and "disk is full" not in message
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)]  # no half-written step_2, no .partial left
    assert not list((tmp_path / "checkpoints").glob("*.partial"))
    assert read_state(step_dir(tmp_path, 1)) == before and newest_valid(tmp_path) == step_dir(tmp_path, 1)
    assert good == str(step_dir(tmp_path, 1))


@pytest.mark.parametrize(
    ("error", "free_mib"),
    [
        # torch.save on a full disk: no errno, only its stream writer's words
        (
            RuntimeError(
                "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0:"
                " file write failed"
            ),
            0,
        ),
        # safetensors (the adapter's file): the OS's words inside its own error type
        (
            Exception(
                "Error while serializing: IoError(Os { code: 28, kind: StorageFull,"
                ' message: "No space left on device" })'
            ),
            500,
        ),
    ],
)
def test_a_full_disk_reported_without_an_errno_is_named_as_one(tmp_path, monkeypatch, error, free_mib):
    """Issue 76: a disk filling mid-checkpoint ended in a traceback that never said "disk"."""
    import shutil

    from tests.checkpoints.test_store import real_checkpoint

    real_checkpoint(tmp_path, 1)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage._replace(free=free_mib << 20))
    monkeypatch.setattr(files.torch, "save", lambda *_a, **_k: (_ for _ in ()).throw(error))
    with pytest.raises(CheckpointError) as info:
        real_checkpoint(tmp_path, 2)
    assert str(info.value) == (
        f"the disk is full while writing {step_dir(tmp_path, 2)}; free space on it ({free_mib} MiB left there), then"
        " continue with trainer.resume=auto: the previous checkpoints are intact"
    )
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)] and not list(
        (tmp_path / "checkpoints").glob("*.partial")
    )


def test_another_write_error_without_an_errno_is_not_called_a_full_disk(tmp_path, monkeypatch):
    from tests.checkpoints.test_store import real_checkpoint

    monkeypatch.setattr(files.torch, "save", lambda *_a, **_k: (_ for _ in ()).throw(RuntimeError("pickling failed")))
    with pytest.raises(RuntimeError, match="pickling failed"):  # plenty of space here: not the disk
        real_checkpoint(tmp_path, 2)


def test_corrupt_files_are_named_and_skipped_for_an_older_checkpoint(trained, tmp_path):
    learner, _, _ = trained
    for step in (1, 2, 3):
        learner.save_checkpoint(str(step_dir(tmp_path, step)), {**META, "step": step})
    blob = step_dir(tmp_path, 3) / "optimizer.pt"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt: optimizer.pt"):
        read_state(step_dir(tmp_path, 3))
    (step_dir(tmp_path, 2) / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match="missing rng.pt"):
        read_state(step_dir(tmp_path, 2))
    skipped = []
    assert newest_valid(tmp_path, skipped.append) == step_dir(tmp_path, 1)
    assert len(skipped) == 2 and "step_00000003" in skipped[0]
    (step_dir(tmp_path, 1) / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_state(step_dir(tmp_path, 1))
    with pytest.raises(CheckpointError, match="not a miniVERL checkpoint"):
        read_state(tmp_path)


def test_load_refuses_an_adapter_that_does_not_hash_to_the_recorded_digest(trained, student_dir, tmp_path):
    learner, _, _ = trained
    path = step_dir(tmp_path, 1)
    learner.save_checkpoint(str(path), META)
    state = json.loads((path / "state.json").read_text())
    state["policy_digest"] = "0" * 64  # files intact, but the recorded identity is not what they hold
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="hashes to"):
        new_learner(student_dir).load_checkpoint(str(path))


def test_a_checkpoint_recorded_with_the_old_sha256_digest_still_resumes(trained, student_dir, tmp_path):
    """Checkpoints written before the fp1 digest recorded SHA-256 over the adapter's bytes: still accepted."""
    from miniverl.policy import DIGEST_PREFIX, sha256_digest

    learner, _, _ = trained
    path = step_dir(tmp_path, 1)
    learner.save_checkpoint(str(path), META)
    state = json.loads((path / "state.json").read_text())
    assert state["policy_digest"].startswith(DIGEST_PREFIX)
    state["policy_digest"] = sha256_digest(adapter_state(learner.model))
    (path / "state.json").write_text(json.dumps(state))
    identity = new_learner(student_dir).load_checkpoint(str(path))
    assert identity.version == learner.version and identity.digest.startswith(DIGEST_PREFIX)
    assert identity.digest == learner.publish_policy().identity.digest


def test_prune_keeps_the_newest_and_removes_partial_writes(tmp_path):
    for step in (1, 2, 3, 10):
        step_dir(tmp_path, step).mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000011.partial").mkdir()
    gone = prune(tmp_path, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000010"]
    assert {p.name for p in gone} == {"step_00000001", "step_00000002", "step_00000011.partial"}


class PoisonedObjective:
    """The real objective, except that its per-token loss is NaN from the `at`-th update on (fault injection)."""

    def __init__(self, inner, at: int) -> None:
        self.inner, self.at, self.calls = inner, at, 0

    def __getattr__(self, name):
        if name == "inner" or name.startswith("__"):  # unpickling in a Ray actor looks these up first
            raise AttributeError(name)
        return getattr(self.inner, name)

    def prepare(self, *args):  # called once per update, before any micro-batch
        self.calls += 1
        return self.inner.prepare(*args)

    def token_loss(self, *args):  # each token's share of the loss the learner backpropagates
        loss = self.inner.token_loss(*args)
        return loss * float("nan") if self.calls >= self.at else loss


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_nonfinite_loss_is_never_applied(parts, student_dir, mode):
    from miniverl.workers.rollout import RolloutWorker

    _, prompts, _, _ = parts
    learner = new_learner(student_dir, PoisonedObjective(GkdObjective(0.5, 1.0, 0), at=2), on_nonfinite=mode)
    ctl = make_controller(RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU), parts)
    ctl.learners = [learner]
    assert ctl.step(prompts, PARAMS)["skipped_step"] == 0.0
    before = adapter_state(learner.model)
    moments = {k: v.clone() for k, v in learner.optimizer.state[learner.params[0]].items()}
    if mode == "stop":
        with pytest.raises(NonFiniteError, match="not finite at policy v1"):
            ctl.step(prompts, PARAMS)
    else:
        metrics = ctl.step(prompts, PARAMS)
        assert metrics["skipped_step"] == 1.0 and metrics["policy_version"] == 1
    assert learner.version == 1
    after = adapter_state(learner.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(v, learner.optimizer.state[learner.params[0]][k]) for k, v in moments.items())
    if mode == "skip":  # the run goes on with the same policy, which the rollout side still serves
        assert ctl.step(prompts, PARAMS)["policy_version"] == 1


def test_a_poisoned_adapter_is_never_saved(trained, tmp_path):
    learner, _, _ = trained
    with torch.no_grad():
        learner.params[0][0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="NaN/inf"):
        learner.save_checkpoint(str(step_dir(tmp_path, 1)), META)
    assert list_checkpoints(tmp_path) == []
