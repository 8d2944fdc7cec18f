# Sourced by the scripts/device/*.sh checks on the GPU machine: where the prebuilt binaries
# ($BIN) and their libraries ($LIBS) are, NCCL's library, the fixtures, and $OUT for the logs.
BIN=${BIN:-.devbin/attn}
export LD_LIBRARY_PATH=${LIBS:-$PWD/.devbin/lib}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
# NCCL: the CUDA toolkit's, else the copy PyTorch's wheels bring.
if ! ls /usr/local/cuda/lib64/libnccl.so.2 >/dev/null 2>&1; then
  nccl=$(find /usr /opt -name libnccl.so.2 2>/dev/null | head -1)
  [ -n "$nccl" ] && export LD_LIBRARY_PATH=$(dirname "$nccl"):$LD_LIBRARY_PATH
fi
export SPARSEMLA_FIXTURES_DIR=${SPARSEMLA_FIXTURES_DIR:-$PWD/tests/fixtures}
export SPARSEMLA_BINARY_PATH=${SPARSEMLA_BINARY_PATH:-$BIN/sparsemla}
export NCCL_NVLS_ENABLE=0
