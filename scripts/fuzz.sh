#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang with ASan + UBSan) in build-fuzz and runs each for
# HLM_FUZZ_SECONDS seconds (default 30) on top of its seed corpus fuzz/corpus/<target>, as many
# at once as there are cores. New inputs go to a scratch directory, never into the committed
# corpus. Any crash, sanitizer report, leak, timeout (10 s per input) or out-of-memory fails the
# script; the input that caused it is kept in build-fuzz/artifacts/ and named in the log.
# Reproduce one: build-fuzz/fuzz/fuzz_<target> build-fuzz/artifacts/<file>
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${HLM_FUZZ_SECONDS:-30}
jobs=$(nproc)
targets=(safetensors config data cli_args tokenizer)

CC=${HLM_FUZZ_CC:-clang} CXX=${HLM_FUZZ_CXX:-clang++} cmake -S . -B build-fuzz -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DHLM_FUZZ=ON -DHLM_CUDA=OFF -DHLM_BUILD_TESTS=OFF -DHLM_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz -j"$jobs" --target "${targets[@]/#/fuzz_}"

mkdir -p build-fuzz/artifacts build-fuzz/logs
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# One thread per target (OpenMP), our own memory check below libFuzzer's (an allocation the
# library refuses is an hlm::Error, one it tries above -malloc_limit_mb a finding).
export OMP_NUM_THREADS=1 HLM_MEMORY_LIMIT=${HLM_MEMORY_LIMIT:-256M}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
run_one() {
  local t=$1
  mkdir -p "$scratch/$t"
  build-fuzz/fuzz/fuzz_"$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=512 -max_len=8192 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/artifacts/$t-" "$scratch/$t" "fuzz/corpus/$t" \
    >"build-fuzz/logs/$t.log" 2>&1
}
failed=()
# In batches of $jobs targets, each batch waited for as a whole.
for ((i = 0; i < ${#targets[@]}; i += jobs)); do
  batch=("${targets[@]:i:jobs}")
  pids=()
  for t in "${batch[@]}"; do
    run_one "$t" &
    pids+=($!)
  done
  for k in "${!batch[@]}"; do
    t=${batch[$k]}
    if wait "${pids[$k]}"; then
      runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "build-fuzz/logs/$t.log" |
        grep -o '[0-9]*$' || echo '?')
      echo "fuzz_$t: ok ($runs inputs in ${secs} s)"
    else
      echo "fuzz_$t: FAILED (log build-fuzz/logs/$t.log):"
      grep -E 'ERROR|SUMMARY|Test unit written|deadly signal|Timeout|out-of-memory' \
        "build-fuzz/logs/$t.log" | head -20 || true
      failed+=("$t")
    fi
  done
done
[ ${#failed[@]} -eq 0 ] || { echo "fuzz: ${#failed[@]} target(s) failed: ${failed[*]}"; exit 1; }
