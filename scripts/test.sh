#!/usr/bin/env bash
# Sets up .venv and runs the default test suite (CPU, offline, a few minutes).
#   bash scripts/test.sh           default suite
#   bash scripts/test.sh --slow    only the slow tests (real embedded model)
#   bash scripts/test.sh --all     everything
# Other arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
marker=(-m "not slow")
case "${1:-}" in
  --slow) marker=(-m slow); shift ;;
  --all) marker=(-m "slow or not slow"); shift ;;
esac
exec .venv/bin/python -m pytest "${marker[@]}" "$@"
