"""The Ray plumbing: starting the actors on the GPUs the setup's placement plan names, GPU memory, and faults."""
