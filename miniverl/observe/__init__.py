"""What a run shows while and after it runs: metrics.jsonl and wandb, Ray dashboard gauges, plots."""
