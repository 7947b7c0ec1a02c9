#!/usr/bin/env bash
# The parity check against transformers' Glm5NextTextModel, on a machine with PyTorch and
# transformers (the reference) and a hybridlm binary. Usage:
#   tools/parity/run_parity.sh HYBRIDLM CONFIG.json WORKDIR [SEQ]
# Builds the reference model from CONFIG (random parameters), saves it to WORKDIR, runs both
# implementations on the same token ids and compares hidden states and every parameter gradient
# (tools/parity/compare.py, tolerance 1e-4):
#   1. hybridlm f64 with its own DSA selections (informative: exact top-k ties, ReLU scores of 0,
#      may be ordered differently by torch.topk, and one different pick changes a row);
#   2. hybridlm f64 and f32 with the reference's DSA selections replayed (--dsa-indices): the
#      pass/fail result.
set -uo pipefail
bin=$1; cfg=$2; dir=$3; seq=${4:-80}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$dir"; mkdir -p "$dir"; cp "$cfg" "$dir/config.json"
python3 "$here/hf_parity.py" "$dir" --seq "$seq" --batch 2 --dtype float64 || exit 1
run() {  # NAME DTYPE [extra args]
  local name=$1 dt=$2; shift 2
  "$bin" forward --model "$dir" --tokens "$dir/tokens.safetensors" \
    --grad-probe "$dir/probe.safetensors" --grad-layout module_tree \
    --out "$dir/ours_$name.safetensors" --dtype "$dt" "$@"
}
if ! run own_f64 f64; then
  echo "== the config.json transformers wrote was refused; retrying with the one it was built from =="
  cp "$dir/config.ours.json" "$dir/config.json"
  run own_f64 f64 || exit 1
fi
run replay_f64 f64 --dsa-indices "$dir/indices.safetensors" || exit 1
run replay_f32 f32 --dsa-indices "$dir/indices.safetensors" || exit 1
echo "== hybridlm f64 (own selections) vs transformers f64 =="
python3 "$here/compare.py" "$dir/ref.safetensors" "$dir/ours_own_f64.safetensors" --tol 1e-4 | tail -n 3
status=0
echo "== hybridlm f64, transformers' DSA selections replayed, vs transformers f64 =="
python3 "$here/compare.py" "$dir/ref.safetensors" "$dir/ours_replay_f64.safetensors" --tol 1e-4 | tail -n 3 || status=1
echo "== hybridlm f32, selections replayed, vs transformers f64 =="
python3 "$here/compare.py" "$dir/ref.safetensors" "$dir/ours_replay_f32.safetensors" --tol 1e-4 | tail -n 3 || status=1
exit $status
