#!/usr/bin/env bash
# The decode step on one GPU, in one call (docs/inference.md, "What a decode step spends").
# Usage: bench/decode_profile.sh BENCH_DECODE [BASE_BENCH_DECODE] [OUT]
#   BENCH_DECODE       a CUDA build's bench/bench_decode;
#   BASE_BENCH_DECODE  optional: another build's bench_decode, timed in the same call (the
#                      machine varies between calls: compare only within one);
#   OUT                the folder for the results (default decode_profile_out).
# 1. the plain step times (batch 1, 8, 64; prompts of 32, 16 new tokens) of each binary;
# 2. each kernel's own time in the decode steps under Nsight Compute (`ncu`, batch 1 and 64, four
#    steps), summed by kernel per step (bench/ncu_kernels.py) into OUT/kernels_b{1,64}.txt.
# Needs ncu on the PATH for step 2 (skipped without it). HLM_DECODE_CONFIG picks the model config
# (default configs/bench_glm_2b.json). Exit status 2 on bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
new=${1:-}
base=${2:-}
out=${3:-decode_profile_out}
if [ -z "$new" ] || [ ! -x "$new" ]; then
  echo "decode_profile: the first argument must be an executable bench_decode, got '$new'" >&2
  exit 2
fi
if [ -n "$base" ] && [ ! -x "$base" ]; then
  echo "decode_profile: the second argument must be an executable bench_decode, got '$base'" >&2
  exit 2
fi
config=${HLM_DECODE_CONFIG:-configs/bench_glm_2b.json}
if [ ! -f "$config" ]; then
  echo "decode_profile: no model config $config" >&2
  exit 2
fi
mkdir -p "$out" || exit 2
args=(--config "$config" --device cuda --prompt 32)
"$new" "${args[@]}" --new 16 --batches 1,8,64 | tee "$out/plain.txt"
if [ -n "$base" ]; then "$base" "${args[@]}" --new 16 --batches 1,8,64 | tee "$out/plain_base.txt"; fi
if ! command -v ncu >/dev/null; then
  echo "decode_profile: ncu not found: per-kernel times skipped" >&2
  exit 0
fi
for b in 1 64; do
  ncu --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --print-units base \
    --log-file "$out/ncu_b$b.csv" "$new" "${args[@]}" --new 5 --batches "$b" >/dev/null
  python3 bench/ncu_kernels.py "$out/ncu_b$b.csv" --steps 4 --top 60 | tee "$out/kernels_b$b.txt"
done
