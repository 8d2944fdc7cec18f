#!/usr/bin/env bash
# The main job on a fresh machine: install, build, and show the engine at work on the bundled
# small model (until the trained default model lands, the GLM-5-architecture fixture).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
model=tests/fixtures/glm_pub/model-f32.gguf
build/sparsemla inspect "$model"
