"""Building one run before Ray starts: checks against the config, models, device and run directory;
models, prompts and rewards loaded in the driver; routing rows to teachers;
where each actor replica goes (placement.py)."""
