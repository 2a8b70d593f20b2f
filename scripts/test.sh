#!/usr/bin/env bash
# Sets up .venv and runs the default test suite (CPU, offline, a few minutes).
#   bash scripts/test.sh           default suite
#   bash scripts/test.sh --slow    only the slow tests (real embedded model, TRL harness, tinker-cookbook recipes;
#                                  installs .[bench,cookbook])
#   bash scripts/test.sh --all     everything
# Other arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
marker=(-m "not slow")
case "${1:-}" in
  --slow) marker=(-m slow); shift; export RLORA_EXTRAS=${RLORA_EXTRAS:-dev,bench,cookbook} ;;
  --all) marker=(-m "slow or not slow"); shift; export RLORA_EXTRAS=${RLORA_EXTRAS:-dev,bench,cookbook} ;;
esac
bash scripts/setup.sh
.venv/bin/lint-imports --no-cache >/dev/null || { .venv/bin/lint-imports --no-cache; exit 1; }  # .importlinter
# one worker per core (pytest-xdist, tests/conftest.py); `-n 0` among the arguments runs in this process
exec .venv/bin/python -m pytest -n auto "${marker[@]}" "$@"
