#!/usr/bin/env bash
# The one set-up command (README, "Set up"): PyTorch built for this machine, then batchinfer with its
# dev extra (tests, readers, the local S3 server the tests start), as an editable install.
#
#   GPU machine (nvidia-smi lists a GPU): torch from the configured index (PyPI's Linux wheels are the
#     CUDA builds, and they bring the matching triton).
#   CPU-only machine: the CPU build of torch, not the several-GB CUDA one: the wheel the configured pip
#     sources pick when it is a CPU build (a local wheelhouse or mirror that serves `+cpu` wheels),
#     else PyTorch's CPU index.
#
# Settings: PYTHON (default python3), TORCH_VERSION (default 2.13.0; empty: the newest),
# TORCH_CPU_INDEX (default https://download.pytorch.org/whl/cpu). A torch already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION-2.13.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
TORCH="torch${TORCH_VERSION:+==$TORCH_VERSION}"

pip() { "$PY" -m pip "$@"; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }

# The version of the torch wheel a plain `pip install torch==V` would pick here ("" if none).
plain_torch_version() {
  pip install --dry-run --no-deps --quiet --report - "$TORCH" 2>/dev/null |
    "$PY" -c 'import json, sys; r = json.load(sys.stdin)["install"]; print(r[0]["metadata"]["version"] if r else "")' 2>/dev/null || true
}

if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: torch $("$PY" -c 'import torch; print(torch.__version__)') is already installed; keeping it"
elif has_gpu; then
  echo "setup: GPU found: installing $TORCH (CUDA build)"
  pip install "$TORCH"
else
  picked="$(plain_torch_version)"
  if [[ "$picked" == *+cpu* ]]; then
    echo "setup: no GPU: installing $TORCH ($picked, a CPU build served by the configured pip sources)"
    pip install "$TORCH"
  else
    echo "setup: no GPU: installing $TORCH (CPU build) from $TORCH_CPU_INDEX"
    pip install "$TORCH" --index-url "$TORCH_CPU_INDEX"
  fi
fi
pip install -e '.[dev]'
"$PY" -m batchinfer.cli --version
