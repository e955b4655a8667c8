#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: .venv in the checkout, the plugin with the
# exact versions of constraints.txt (torch 2.13.0 CPU build, torchtitan 0.2.2, ...),
# and the demo assets. The plugin's own requirements are ranges (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
stamp=.venv/.titan_ckpt_plus-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing titan_ckpt_plus with the pinned versions of constraints.txt into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test,hf]"
  echo "$want" > "$stamp"
fi
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python -m titan_ckpt_plus.demo_assets assets/demo
