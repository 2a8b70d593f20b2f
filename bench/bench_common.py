"""Shared by the benchmarks (both sides of the TRL comparison among them): the prompts, the reward function and
the models."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlora.config import DataConfig
from rlora.data.prompts import load_prompt_sets
from rlora.models.embedded import SMOLLM2_ALIAS, cache_root, resolve_alias
from rlora.rewards.builtin import closeness_reward, extract_answer

TASK = "chain_sum"
TASK_ARGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TRAIN_SEED, EVAL_SEED = 0, 1_000_003


def completion_text(completion) -> str:
    """TRL passes conversational completions as [{'role': 'assistant', 'content': ...}]; rlora passes text."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


def answer_reward(prompts, completions, answer, **_columns) -> list[float]:
    """1.0 when the extracted answer (tags, else last number) equals the reference exactly (chain_sum: integers)."""
    return [1.0 if extract_answer(completion_text(c)) == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def closeness(prompts, completions, answer, **_columns) -> list[float]:
    """rlora's built-in `closeness` shaping on either side's completions (TRL passes them as messages)."""
    return closeness_reward(prompts, [completion_text(c) for c in completions], answer)


def reward_setup(closeness_weight: float) -> tuple[list, list[float]]:
    """The reward functions and weights both sides train on: the exact answer, plus the demo's `closeness` shaping
    where it has a weight (the held-out accuracy counts the exact answer only)."""
    if not closeness_weight:
        return [answer_reward], [1.0]
    return [answer_reward, closeness], [1.0, closeness_weight]


def rlora_rewards(closeness_weight: float) -> list[dict]:
    """reward_setup's functions and weights as rlora's `rewards` config."""
    return [{"fn": f"bench_common.{fn.__name__}", "weight": weight} for fn, weight in zip(*reward_setup(closeness_weight))]


def task_rows(split: str, train_size: int = 1000, eval_size: int = 100) -> list[dict]:
    """Chat-format prompts with their answers: the same rows feed rlora (jsonl) and TRL (datasets). The split
    is rlora's (the demo's): held-out problems are distinct and never appear in the training rows."""
    cached = cache_root() / "bench" / f"{TASK}-{split}-{train_size}-{eval_size}.jsonl"  # machines without reasoning-gym
    if cached.is_file():
        return [json.loads(line) for line in cached.read_text().splitlines()]
    cfg = DataConfig(task=TASK, task_args=TASK_ARGS, train_size=train_size, eval_size=eval_size,
                     seed=TRAIN_SEED, eval_seed=EVAL_SEED)
    examples = getattr(load_prompt_sets(cfg), split)
    rows = [{"prompt": [{"role": "user", "content": ex.prompt}], "answer": ex.columns["answer"]} for ex in examples]
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(rows, cached.with_suffix(".tmp")).replace(cached)  # a cut-off write leaves no cache behind
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# random-initialised Qwen2 shapes built by the benchmarks (with the SmolLM2 tokenizer; ids beyond its 49152
# tokens decode to nothing, which only matters for the text, not the work)
RANDOM_SHAPES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128),  # per-token overhead, not arithmetic
    "qwen2-0.1b": dict(hidden=768, layers=12, heads=12, kv_heads=4, ffn=3072),
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab_size=151936),
    # Gemma-3-270M's shape: five sliding-window layers (512) to one global, 256-wide heads, one KV head
    "gemma3-270m": dict(family="gemma3_text", hidden=640, layers=18, heads=4, kv_heads=1, ffn=2048, head_dim=256,
                        query_pre_attn_scalar=256, sliding_window=512, vocab_size=262144,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3),
    # a mixture of experts shaped like a small Qwen3-30B-A3B: 32 experts, 4 a token, every layer sparse
    "qwen3-moe-0.1b": dict(family="qwen3_moe", hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, ffn=1536,
                           num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, mlp_only_layers=[],
                           norm_topk_prob=True),
}


def model_folder(name: str) -> str:
    """'smollm2': the embedded SmolLM2-135M-Instruct; 'tiny' (hidden 64, 2 layers: what a step costs besides
    arithmetic), 'qwen2-0.1b' (hidden 768, 12 layers, 12 heads, 4 KV
    heads, FFN 3072) and 'qwen2.5-0.5b' (vocab 151936, hidden 896, 24 layers, 14 heads, 2 KV heads, FFN
    4864, tied embeddings), 'gemma3-270m' (Gemma 3 text: vocab 262144, hidden 640, 18 layers, a window of 512 on
    five of every six), 'qwen3-moe-0.1b' (Qwen3-MoE: hidden 512, 8 layers, 32 experts of width 256, 4 a token):
    random-initialised, built once into the cache; any other value is a model folder."""
    if name == "smollm2":
        return resolve_alias(SMOLLM2_ALIAS)
    if name in RANDOM_SHAPES:
        folder = cache_root() / "bench" / f"{name}-random"
        if not (folder / "config.json").is_file():
            from transformers import AutoTokenizer

            from rlora.models.tiny import build_random_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_alias(SMOLLM2_ALIAS))
            shape = {"family": "qwen2", **RANDOM_SHAPES[name]}
            build_random_model(folder, tokenizer=tokenizer, tie=True, seed=0, **shape)
        return str(folder)
    return name


STEP_PHASES = ("step_s", "rollout_s", "ref_s", "old_s", "train_s", "optim_s")


def step_phases(rows: list[dict]) -> dict:
    """Median seconds per step of each phase of a run's metrics.jsonl rows (the first step is left out: it warms
    up the allocator)."""
    import statistics

    rows = rows[1:] or rows
    return {key: statistics.median(r.get(key) or 0.0 for r in rows) for key in STEP_PHASES}


def run_parser(doc: str, steps: int, repeats: int):
    """The argument parser of a benchmark that runs `rlora train` --repeats times for --steps steps, into --out."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", default=None, help="folder for the runs and report.json (default: a temporary one)")
    return parser


def output_folder(out: str | None, prefix: str) -> Path:
    import tempfile

    folder = Path(out or tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def random_up_factors(model, seed: int, scale: float = 0.01):
    """The LoRA's B (up) factors drawn N(0, scale^2), so the adapter changes the outputs (peft starts B at 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return model
