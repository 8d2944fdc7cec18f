#!/usr/bin/env bash
# Here (not on the GPU machine): packs the built binaries and the libraries the GPU machine lacks
# into one archive for a device run, in a folder git ignores, and prints its size.
#   scripts/device/pack.sh [BINARIES...]   default: sparsemla sparsemla_tests bench_cuda_matmul
# The tracked tree (models/, fixtures) is ~52 MB of the 64 MiB a call carries, so the archive must
# stay under ~12 MB: the binaries share most of their code, and one xz -9e archive of them holds it
# once. Build them for the device's SASS only (the PTX doubles the fatbinary): a build directory
# configured with -DCMAKE_CUDA_ARCHITECTURES=90-real packs sparsemla + sparsemla_tests +
# bench_cuda_matmul into 10.2 MB (session 32), where the "90" build (SASS + PTX) packs 18.9 MB.
# SPARSEMLA_BUILD_DIR picks the build directory (default build).
# On the machine: tar -xJf .devbin/pack/p.tar.xz -C /tmp/b; BIN=/tmp/b LIBS=/tmp/b/lib (env.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${SPARSEMLA_BUILD_DIR:-build}
bins=("$@")
[ ${#bins[@]} -eq 0 ] && bins=(sparsemla sparsemla_tests bench_cuda_matmul)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
for b in "${bins[@]}"; do
  f=$(find "$build" -maxdepth 2 -type f -name "$b" -perm -u+x | head -1)
  [ -n "$f" ] || { echo "pack: no $b under $build" >&2; exit 1; }
  cp "$f" "$stage/"
  strip "$stage/$b" 2>/dev/null || true
  # Non-system libraries (the CUDA toolkit's are on the machine).
  for l in $(ldd "$f" | awk '/=>/ {print $3}'); do
    case "$l" in
      /usr/local/cuda*|*/libc.so*|*/libm.so*|*/libstdc++*|*/libgcc_s*|*/libpthread*|*/libdl.so*|*/librt.so*) ;;
      *) cp -L "$l" "$stage/lib/" ;;
    esac
  done
done
mkdir -p .git/info
grep -qx '/.devbin/' .git/info/exclude 2>/dev/null || echo '/.devbin/' >> .git/info/exclude
mkdir -p .devbin/pack
tar -cf - -C "$stage" . | xz -9e -T0 > .devbin/pack/p.tar.xz
ls -l .devbin/pack/p.tar.xz
