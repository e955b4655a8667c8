#!/usr/bin/env bash
# The GPU check (issue 16), prepared to run as ONE call of the device tool on a lent
# NVIDIA H200 (Python 3.12 with torch 2.11.0+cu130 preinstalled, no network), in at most
# 8 minutes: it installs the carried wheels, builds the demo assets if they did not
# travel, and runs scripts/bench_gpu.py, which prints one table (resume bit-exact on
# CUDA; per save, blocked time and step time lost, plugin vs stock async and
# async_with_pinned_mem on the 1B flavor; time to a durable local commit vs the fsync'd
# write bandwidth; steps during the background write; host memory pinned for staging) and writes it into this copy's
# BENCHMARKS.md ("## GPU") and $OUT/gpu_section.md. Nothing is written off a GPU.
#
# Here, before the call (needs the package registry; .whl/ is ignored):
#   ./scripts/gpu_wheels.sh     # python3 -m pip download --no-deps --only-binary=:all: \
#       --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#       torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 \
#       typeguard==4.6.1 typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 \
#       multiprocess==0.70.19 crc32c==2.9.post0
# The call: command "./scripts/gpu_check.sh", carry [".whl", "assets"], timeout_s 540.
# Here, after it: .venv/bin/python scripts/bench_gpu.py --apply <files_at>/gpu_section.md
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export OUT
ls .whl/*.whl >/dev/null || { echo "no .whl/: run ./scripts/gpu_wheels.sh here first"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, torchtitan, datasets, tyro; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  || echo "[gpu_check] an import failed (above); bench_gpu.py reports each phase anyway"
[ -f assets/demo/demo_assets.json ] || python3 -m titan_ckpt_plus.demo_assets assets/demo
# bench_gpu ends its last run within about 60 s of --budget-s; the outer timeout is a backstop.
# Arguments go to bench_gpu.py (a shorter second call: --no-resume --modes plugin,helper).
budget=${GPU_BUDGET_S:-370}
status=0
timeout $((budget + 85)) python3 scripts/bench_gpu.py --update BENCHMARKS.md --budget-s "$budget" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log" || status=$?
cp BENCHMARKS.md "$OUT/"
exit "$status"
