"""One training step and what it proves: the controller's phases, the one owner of the served policy and
its proof, the start-of-run gate, evaluation and the run's summary, seeds, and the cadence of steps from any
step k."""
