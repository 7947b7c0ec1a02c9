#!/usr/bin/env bash
# Gather the GPU test and benchmark binaries of a CUDA build with the non-system shared libraries
# they need into one folder that can travel to the GPU machine. Usage: scripts/gpu_pack.sh BUILD PACK
# [TARBALL]: with TARBALL (e.g. gpu_pack_t/p.tar.xz, in an ignored folder) it also writes the pack
# xz-compressed (Debian's OpenBLAS alone is 36 MB: the uncompressed pack nears the 64 MiB a device
# call can carry); unpack it there with `tar xJf TARBALL`.
set -euo pipefail
build=$1; pack=$2; tarball=${3:-}
rm -rf "$pack"; mkdir -p "$pack/lib"
# HLM_PACK_BINS (paths under BUILD, space-separated) picks fewer: a device call carries 64 MiB.
bins=(hybridlm tests/hlm_gpu_tests bench/bench_kda_decode_gpu bench/bench_dsa_gpu
      bench/bench_ce_embedding_gpu bench/bench_model_gpu bench/libhlm_kda_bench.so
      bench/kda_lab/kda_bits bench/kda_lab/kda_stage_timer bench/kda_lab/kda_tf32_study)
if [ -n "${HLM_PACK_BINS:-}" ]; then read -r -a bins <<<"$HLM_PACK_BINS"; fi
for b in "${bins[@]}"; do [ -f "$build/$b" ] && cp "$build/$b" "$pack/"; done
# Libraries from Debian packages that a CUDA image may lack (the CUDA ones are on the machine).
for b in "$pack"/*; do
  [ -f "$b" ] || continue
  ldd "$b" | awk '/=> \//{print $3}' | grep -E 'fmt|openblas|gfortran|quadmath|benchmark|gomp|pcre2|icu|httplib|brotli|mpi|open-pal|open-rte|hwloc|event|pmix|udev|ltdl' || true
done | sort -u | while read -r lib; do cp -L "$lib" "$pack/lib/"; done
du -sh "$pack"
if [ -n "$tarball" ]; then
  mkdir -p "$(dirname "$tarball")"
  tar cf - "$pack" | xz -T2 -6 > "$tarball"
  du -sh "$tarball"
fi
