#!/usr/bin/env bash
# The command run on the GPU machine (from the repository root, $OUT set by the device tool):
#   bash scripts/train_tiny/device_run.sh MINUTES [more train.py options]
# First a smoke run (--smoke: seconds of training, the whole pipeline); if it passes, the real run
# of MINUTES minutes of training, killed at DEADLINE seconds after the start (default 570). Returns
# the run's folder (without the fp32 checkpoint, unless no GGUF was written) as result.tgz.* parts
# of at most 15 MiB, and the logs.
set -u
start=$(date +%s)
root="$(pwd)"
export LD_LIBRARY_PATH="$root/scripts/train_tiny/bin:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
minutes="$1"; shift
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
rm -rf /tmp/tiny_smoke /tmp/tiny_run && mkdir -p /tmp/tiny_smoke /tmp/tiny_run
if [ "${SKIP_SMOKE:-0}" != 1 ]; then
  timeout 150 python3 scripts/train_tiny/train.py --sparsemla "$root/scripts/train_tiny/bin/sparsemla" \
    --out /tmp/tiny_smoke --smoke "$@" > "$OUT/smoke_log.txt" 2>&1
  rc=$?
  echo "smoke exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/smoke_log.txt"
  if [ $rc != 0 ]; then tail -n 60 "$OUT/smoke_log.txt"; exit 1; fi
  tail -n 12 "$OUT/smoke_log.txt"
fi
left=$(( ${DEADLINE:-570} - ($(date +%s) - start) ))
timeout "$left" python3 scripts/train_tiny/train.py --sparsemla "$root/scripts/train_tiny/bin/sparsemla" \
  --out /tmp/tiny_run --minutes "$minutes" "$@" > "$OUT/log.txt" 2>&1
echo "train.py exit $? after $(( $(date +%s) - start )) s" >> "$OUT/log.txt"
tail -n 40 "$OUT/log.txt"
cd /tmp/tiny_run
if [ -f tiny-glm5-q8_0.gguf ]; then ex=(--exclude=checkpoint_bf16.pt); else ex=(); fi
tar czf - "${ex[@]}" . | split -b 15m - "$OUT/result.tgz."
ls -la /tmp/tiny_run "$OUT"
