#!/usr/bin/env bash
# Install what is missing, build, and run the whole test suite:
#  1. the Release build (CUDA kernels compiled when nvcc is present) and all its tests; GPU tests
#     (ctest label gpu) skip with a reason when no GPU is present. Without a GPU (nvidia-smi lists
#     none) the GPU test program is left out of this build and the kernels are compiled to PTX
#     only (HLM_CUDA_ARCH=90a-virtual: nvcc checks the code, ptxas does not run): stage 3 runs
#     the GPU tests on the emulation;
#  2. the CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer;
#  3. where the CUDA toolkit is installed, the GPU tests on the CPU emulation of CUDA
#     (tools/cuda_emu: the same kernels compiled as C++), with the race check on;
#  4. the fuzz targets (scripts/fuzz.sh: clang + libFuzzer, HLM_FUZZ_SECONDS each, 10 here; the
#     script's own default is 30) on top of their seed corpus; any crash fails.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# ctest runs tests in parallel and each test's OpenMP regions use every core: threads that spin
# while they wait would steal the cores of the other tests.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
bash scripts/setup.sh
echo "== build (Release) =="
# Tests and benchmarks on explicitly: the build folder may hold scripts/run.sh's configuration.
if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  gpu=(-DHLM_GPU_TESTS=ON -DHLM_CUDA_ARCH=90a)
else
  gpu=(-DHLM_GPU_TESTS=OFF -DHLM_CUDA_ARCH=90a-virtual)
fi
bash scripts/build.sh build -DHLM_BUILD_TESTS=ON -DHLM_BUILD_BENCH=ON "${gpu[@]}"
echo "== tests (Release) =="
(cd build && ctest --output-on-failure --no-tests=error -j"$jobs" --timeout 900)
echo "== build (ASan + UBSan, CPU) =="
# -O1 with line tables only (-g1): what the sanitizers' reports need, and a faster build than
# RelWithDebInfo's -O2 -g.
bash scripts/build.sh build-asan -DHLM_CUDA=OFF -DHLM_SANITIZE=ON -DHLM_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG"
echo "== tests (ASan + UBSan, CPU) =="
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
(cd build-asan && ctest --output-on-failure --no-tests=error -j"$jobs" -L cpu --timeout 1800)
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== build (CUDA kernels emulated on the CPU) =="
  # The two test programs only: no GPU test runs the command-line binary.
  cmake -S . -B build-emu -G Ninja -DCMAKE_BUILD_TYPE=Release -DHLM_CUDA_EMU=ON \
    -DHLM_BUILD_BENCH=OFF >/dev/null
  cmake --build build-emu -j"$jobs" --target hlm_gpu_tests hlm_cuda_emu_tests
  echo "== GPU tests on the CPU emulation, race check on =="
  (cd build-emu && HLM_EMU_RACECHECK=1 ctest --output-on-failure --no-tests=error -j"$jobs" \
    -L 'gpu|emu' --timeout 1800)
else
  echo "== no CUDA toolkit: the GPU tests on the CPU emulation are skipped =="
fi

# ---- fuzzing ---------------------------------------------------------------------------------
export HLM_FUZZ_SECONDS=${HLM_FUZZ_SECONDS:-10}
echo "== fuzz targets (clang + libFuzzer, ${HLM_FUZZ_SECONDS} s each) =="
bash scripts/fuzz.sh
