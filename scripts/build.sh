#!/usr/bin/env bash
# Configures and builds into build/. CUDA kernels are built when nvcc is found.
#   SPARSEMLA_CUDA_ARCHS  CUDA architectures (default: the full fatbinary of CMakeLists.txt;
#                         scripts/test.sh passes a reduced list to keep CI within its time)
#   SPARSEMLA_BUILD_DIR   build folder (default build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${SPARSEMLA_BUILD_DIR:-build}
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
args=(-DCMAKE_BUILD_TYPE=Release)
[ -n "${SPARSEMLA_CUDA_ARCHS:-}" ] && args+=("-DCMAKE_CUDA_ARCHITECTURES=${SPARSEMLA_CUDA_ARCHS}")
cmake -S . -B "$build" "${args[@]}" "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
