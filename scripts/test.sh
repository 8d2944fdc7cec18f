#!/usr/bin/env bash
# The test command: installs dependencies, builds, and runs every test (CPU tests everywhere;
# GPU tests run only where a GPU is present and are reported as skipped otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
# One architecture keeps the CUDA build within CI's time; the full fatbinary is the default of
# scripts/build.sh and CMakeLists.txt.
export SPARSEMLA_CUDA_ARCHS=${SPARSEMLA_CUDA_ARCHS:-80}
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
scripts/fuzz.sh smoke
