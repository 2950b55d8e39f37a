"""sitecustomize for the SGLang engine's processes: rollout/sglang.py use_compat_shim puts this folder on their
PYTHONPATH."""
