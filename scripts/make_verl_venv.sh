#!/usr/bin/env bash
# Build a separate virtualenv holding verl from PyPI, for the bridge's verl-backed tests (tests/bridge/).
#
# verl pins transformers<5.11 and tensordict<=0.10 while miniVERL runs newer ones, so verl lives in its own
# venv. --system-site-packages reuses this machine's torch (CPU build) instead of letting pip resolve verl's
# dependency tree, which would pull a CUDA torch of several GB: verl is installed with --no-deps, and only
# the small packages that verl.protocol, its core_algos and its Hydra config composition import are added.
#
# Usage: scripts/make_verl_venv.sh [VENV_DIR]    (default: $MINIVERL_VERL_VENV or ~/.cache/miniverl/verl-venv)
# Idempotent: an existing venv whose verl imports at the pinned version is left as it is.
set -euo pipefail

VERL_VERSION="0.9.1"   # the version the bridge targets (miniverl/bridge/versions.py)
VENV="${1:-${MINIVERL_VERL_VENV:-$HOME/.cache/miniverl/verl-venv}}"
PY="$VENV/bin/python"

# The check imports what the tests import (core_algos pulls in transformers), so a venv broken by a change in the
# system site-packages it shares is rebuilt rather than kept.
if [ -x "$PY" ] && "$PY" -c "import verl, sys; from verl.trainer.ppo import core_algos; sys.exit(verl.__version__ != '$VERL_VERSION')" 2>/dev/null; then
  echo "verl $VERL_VERSION venv already at $VENV"
  exit 0
fi

start=$(date +%s)
python3 -m venv --system-site-packages "$VENV"
# The system torch must stay the one verl sees: refuse to go on if the venv resolves another.
"$PY" -c "import torch; print('torch', torch.__version__)"
# kernels: transformers 5.25 (ours) depends on kernels 0.19, which the venv sees through the system site-packages;
# kernels >= 0.17 refuses the revision-less LayerRepository that transformers 5.10 (verl's) builds at import, so
# the venv carries its own older copy.
"$PY" -m pip install -q --no-deps \
  "verl==$VERL_VERSION" \
  "transformers>=5.5.3,<5.11,!=5.6.0" "tokenizers>=0.22,<=0.23.0" "huggingface-hub>=1.5,<2" \
  "tensordict>=0.8,<=0.10.0,!=0.9.0" \
  pyvers importlib_metadata codetiming dill pybind11 pylatexenc \
  pandas pyarrow tzdata python-dateutil \
  "kernels>=0.10.2,<0.17"
# The venv must still use the CPU torch it started with (no CUDA build pulled in).
"$PY" - <<'PY'
import torch, verl
assert "+cu" not in torch.__version__, f"a CUDA torch was installed into the verl venv: {torch.__version__}"
from verl import DataProto  # noqa: F401
from verl.trainer.ppo import core_algos  # noqa: F401
print("verl", verl.__version__, "torch", torch.__version__)
PY
end=$(date +%s)
echo "created $VENV in $((end - start)) s, $(du -sh "$VENV" | cut -f1)"
