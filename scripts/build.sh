#!/usr/bin/env bash
# Configure and build. Usage: scripts/build.sh [BUILD_DIR] [extra cmake args...]
# CUDA kernels are built when nvcc is found (/usr/local/cuda/bin/nvcc or on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}; shift || true
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$dir" -j"$(nproc)"
