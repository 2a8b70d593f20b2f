#!/usr/bin/env bash
# Sets up .venv and runs the embedded demo (`rlora train` with no config). Extra arguments are passed on,
# e.g. `bash scripts/demo.sh train.steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rlora train "$@"
