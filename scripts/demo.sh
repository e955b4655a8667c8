#!/usr/bin/env bash
# The demo: torchtitan's debugmodel on 2 CPU ranks with both tiers on
# (train_configs/debug_tiered.toml). Rank 1 is SIGKILLed after step 27; the job is
# started again with the same command, resumes from the newest local step (25, newer
# than the newest PFS step, 20) and finishes. Then a summary of what the plugin did.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
DUMP=outputs/debug_tiered
rm -rf "$DUMP" outputs/demo-run*.log
mkdir -p outputs
# fp32 mixed precision where the CPU has no bf16 dot products (bf16 would run a scalar
# matrix multiply, each step several times slower; the saved state is fp32 either way).
read -ra PRECISION <<< "$(.venv/bin/python -c "from titan_ckpt_plus.cpu_fallback import fp32_args; print(*fp32_args())")"
if [ ${#PRECISION[@]} -gt 0 ]; then
  echo "== this CPU has no bf16 dot products: training in fp32 mixed precision"
fi
train() {
  .venv/bin/torchrun --standalone --nproc_per_node 2 -m torchtitan.train \
    --job.config_file train_configs/debug_tiered.toml "${PRECISION[@]}" "$@"
}
echo "== run 1: training; rank 1 will be killed after step 27 (log: outputs/demo-run1.log)"
if TITAN_CKPT_FAULT="kill_after_step@27:1" train > outputs/demo-run1.log 2>&1; then
  echo "run 1 was expected to die"; exit 1
fi
grep -h "SIGKILL\|committed\|PFS step" outputs/demo-run1.log | sed 's/^.* - //' | awk '!seen[$0]++' | tail -4
echo "== run 2: the same command again (log: outputs/demo-run2.log)"
train > outputs/demo-run2.log 2>&1 || { tail -40 outputs/demo-run2.log; exit 1; }
grep -h "recovered step\|skipped\|Training starts" outputs/demo-run2.log | sed 's/^.* - //' | awk '!seen[$0]++'
echo "== summary"
.venv/bin/titan-ckpt summary "$DUMP"
