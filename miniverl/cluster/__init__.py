"""The Ray plumbing: starting the actors, where they go (GPUs, placement), GPU memory, and faults."""
