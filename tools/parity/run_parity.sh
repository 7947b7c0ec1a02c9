#!/usr/bin/env bash
# The parity check against transformers' Glm5NextTextModel, on a machine with PyTorch and
# transformers (the reference) and a hybridlm binary. Usage:
#   tools/parity/run_parity.sh HYBRIDLM CONFIG.json WORKDIR [SEQ]
# Builds the reference model from CONFIG (random parameters), saves it to WORKDIR, runs both
# implementations on the same token ids (FP64 reference; hybridlm in FP64 and in FP32) and
# compares hidden states and every parameter gradient (tools/parity/compare.py, tolerance 1e-4).
set -uo pipefail
bin=$1; cfg=$2; dir=$3; seq=${4:-80}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$dir"; mkdir -p "$dir"; cp "$cfg" "$dir/config.json"
python3 "$here/hf_parity.py" "$dir" --seq "$seq" --batch 2 --dtype float64 || exit 1
run() {  # dtype
  "$bin" forward --model "$dir" --tokens "$dir/tokens.safetensors" \
    --grad-probe "$dir/probe.safetensors" --out "$dir/ours_$1.safetensors" --dtype "$1"
}
if ! run f64; then
  echo "== the config.json transformers wrote was refused; retrying with the one it was built from =="
  cp "$dir/config.ours.json" "$dir/config.json"
  run f64 || exit 1
fi
run f32 || exit 1
status=0
echo "== hybridlm f64 vs transformers f64 =="
python3 "$here/compare.py" "$dir/ref.safetensors" "$dir/ours_f64.safetensors" --tol 1e-4 | tail -n 40 || status=1
echo "== hybridlm f32 vs transformers f64 =="
python3 "$here/compare.py" "$dir/ref.safetensors" "$dir/ours_f32.safetensors" --tol 1e-4 | tail -n 5 || status=1
exit $status
