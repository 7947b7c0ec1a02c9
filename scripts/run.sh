#!/usr/bin/env bash
# Install what is missing, build, and run the main job (`hybridlm` with no arguments).
# Extra arguments are passed to hybridlm: scripts/run.sh op kda --in a.safetensors --out b.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh build -DHLM_BUILD_TESTS=OFF -DHLM_BUILD_BENCH=OFF
exec ./build/hybridlm "$@"
