#!/usr/bin/env bash
# The main job on a fresh machine: install, build, and let the bundled model (models/, a small
# GLM-5-architecture model trained for this project) answer a prompt on the CPU, with the model's
# own sparse attention.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
echo "== sparsemla run --chat --prompt 'Tell me a fortune.'"
build/sparsemla run --chat --prompt "Tell me a fortune." --max-tokens 48
echo "== sparsemla run --prompt 'The history of the city'"
build/sparsemla run --prompt "The history of the city" --max-tokens 48
