"""The verl bridge: carry a miniVERL run to verl 0.9, and refuse (listing every reason) what verl cannot reproduce.

- data.py        prompt rows in verl's parquet schema (export, read back, round trip)
- batches.py     rollout/training batches as safetensors + JSON manifest under verl's key names; DataProto
- spec.py        a run as the bridge sees it (RunSpec)
- checks.py      one function per reason verl 0.9 cannot express a run
- refusals.py    runs every check before anything is written; VerlRefusal lists all reasons
- translate.py   a MiniVerlConfig as overrides of verl's `main_ppo` config (YAML and command line)
- runs.py        a run directory or config YAML, typed and validated, as the refusals see it
- export.py      `export-verl` and `export-data`: refuse, or write one directory atomically
- rewards.py     the reward verl calls: the run's scorers routed by data_source, or its custom function
- verl_check.py  runs inside a verl virtualenv (scripts/make_verl_venv.sh) to verify exports with verl itself

Nothing here imports verl; `batches.to_dataproto` imports it when called.
"""
