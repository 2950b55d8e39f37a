"""Checkpoints of a run: written atomically by the learner (files.py), found and pruned in the run
directory (store.py), and checked against the resuming run's config (compat.py)."""
