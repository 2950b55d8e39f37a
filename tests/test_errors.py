"""The one-line message of an error miniverl raises on purpose, also when a Ray actor raised it."""

from __future__ import annotations

from miniverl.errors import DiskFullError, MiniVerlError, message_of


def test_an_error_raised_in_an_actor_keeps_its_own_one_line_message():
    """Issue 76: a full disk in the learner's checkpoint reached the user as Ray's remote traceback (RayTaskError's
    text), which main printed and summary.json cut to its first line, "ray::LearnerWorker.save_checkpoint() ..."."""
    from ray.exceptions import RayTaskError

    raised = DiskFullError("the disk is full while writing out/checkpoints/step_00000002; free space on it, then ...")
    remote = RayTaskError("LearnerWorker.save_checkpoint", "Traceback (most recent call last):\n  ...", raised)
    arrived = remote.as_instanceof_cause()  # what ray.get raises in the driver
    assert isinstance(arrived, MiniVerlError) and str(arrived).count("\n") > 0
    assert message_of(arrived) == str(raised)
    assert message_of(raised) == str(raised)
