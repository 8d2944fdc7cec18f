#!/usr/bin/env bash
# Installs what sparsemla needs to build and test on Debian 12, from Debian's packages.
# CUDA is optional: with nvcc on PATH (or /usr/local/cuda) the GPU kernels are built too.
set -euo pipefail
pkgs=(build-essential cmake git pkg-config
      libfmt-dev libcli11-dev nlohmann-json3-dev libcpp-httplib-dev libspdlog-dev
      libgtest-dev libgmock-dev libbenchmark-dev
      clang libclang-rt-14-dev
      python3 python3-numpy python3-jinja2 unicode-data
      chromium)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
