#!/usr/bin/env bash
# Installs the Debian packages hybridlm builds with (idempotent; quiet when all are present).
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config git clang-format
      libopenblas-dev nlohmann-json3-dev libcli11-dev libfmt-dev
      libgtest-dev libgmock-dev libbenchmark-dev libomp-dev
      libopenmpi-dev openmpi-bin gnuplot-nox
      libpcre2-dev libicu-dev  # the tokenizer: pre-tokenizer regexes (PCRE2), NFC (ICU)
      libcpp-httplib-dev       # hybridlm serve
      clang libclang-rt-14-dev)  # the fuzz targets (scripts/fuzz.sh): clang 14 and libFuzzer
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
