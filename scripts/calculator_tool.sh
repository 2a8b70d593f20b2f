#!/usr/bin/env bash
# The calculator tool demo (docs/environments.md): synthetic tool-use conversations -> `rlora sft` warm-up ->
# `rlora train` with the calculator environment. Output under runs/calculator_tool/. Extra arguments go to the
# RL stage, e.g. `bash scripts/calculator_tool.sh train.steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p runs/calculator_tool
.venv/bin/python -m rlora.envs.tool_data configs/calculator_tool.yaml --size 2000 --out runs/calculator_tool/sft.jsonl
.venv/bin/rlora sft configs/calculator_tool_sft.yaml train.overwrite=true
exec .venv/bin/rlora train configs/calculator_tool.yaml train.overwrite=true "$@"
