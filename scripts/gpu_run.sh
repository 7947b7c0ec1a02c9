#!/usr/bin/env bash
# On the GPU machine: run the GPU tests and the GPU benchmarks of a CUDA build made beforehand
# (scripts/build.sh build-cuda) and carried with its shared libraries (scripts/gpu_pack.sh).
# Usage: scripts/gpu_run.sh PACK_DIR [OUT_DIR] [BASE_KDA_BITS]
# HLM_GPU_TEST_FILTER (a gtest filter, default all) picks the GPU tests to run.
# BASE_KDA_BITS: a kda_bits program built from an earlier revision (bench/kda_lab/README.md): its
# tensors and this pack's must be bit-identical when the change was not meant to move any bit.
set -uo pipefail
pack=$1; out=${2:-/tmp}; base_bits=${3:-}
export LD_LIBRARY_PATH="$pack/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== GPU tests =="
# Into the log first, then a summary from it: a reader that stops early (head) must not end the
# tests through a broken pipe.
"$pack/hlm_gpu_tests" --gtest_filter="${HLM_GPU_TEST_FILTER:-*}" > "$out/gpu_tests.log" 2>&1
echo "hlm_gpu_tests exit status $?"
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|DISABLED|SKIPPED \]" "$out/gpu_tests.log" | head -40
if [ -x "$pack/kda_bits" ]; then
  echo "== KDA chunked kernels: bits (bench/kda_lab/kda_bits) =="
  "$pack/kda_bits" /tmp/kda_bits_new.safetensors >/dev/null && sha256sum /tmp/kda_bits_new.safetensors
  if [ -n "$base_bits" ]; then
    "$base_bits" /tmp/kda_bits_base.safetensors >/dev/null && sha256sum /tmp/kda_bits_base.safetensors
    "$pack/kda_bits" --compare /tmp/kda_bits_base.safetensors /tmp/kda_bits_new.safetensors
  fi
fi
if [ -x "$pack/bench_dsa_gpu" ]; then
  echo "== bench: DSA ops at GLM-5.3-Flash shapes =="
  "$pack/bench_dsa_gpu" 2>&1 | tee "$out/bench_dsa.log"
fi
echo "== bench: KDA decode (ours) =="
"$pack/bench_kda_decode_gpu" 2>&1 | tee "$out/bench_kda_decode.log"
if [ -d .whl ]; then
  echo "== bench: KDA decode (FLA fused_recurrent_kda, anchor) =="
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 \
    python3 bench/kda_decode_fla.py 2>&1 | tee "$out/bench_kda_decode_fla.log" | tail -8
fi
