#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite: unit tests and the torchrun
# end-to-end runs on CPU with gloo. Extra arguments go to pytest (e.g. -m "not e2e").
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
