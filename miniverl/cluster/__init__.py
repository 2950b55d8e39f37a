"""The Ray plumbing: starting the actors on the GPUs the setup's placement plan names, and faults."""
