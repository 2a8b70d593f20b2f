"""One evaluator for adapters trained by either side: rlora's greedy held-out evaluation on the demo task."""

from __future__ import annotations

from bench_common import answer_reward, model_folder, task_rows
from rlora.config import ModelConfig
from rlora.data.prompts import render_prompt
from rlora.models.loading import load_base_model, load_tokenizer
from rlora.rewards.scoring import RewardFn
from rlora.rollout.generator import HFGenerator
from rlora.train.evaluate import evaluate
from rlora.train.sources import Completions
from rlora.types import Example, SamplingParams


def evaluate_adapters(adapters: dict[str, str], eval_size: int, max_new_tokens: int, model: str = "smollm2") -> dict:
    """-> {'base': accuracy, name: accuracy, ...} on the same held-out prompts, greedy."""
    from peft import PeftModel

    folder = model_folder(model)
    tokenizer, tok = load_tokenizer(folder)
    rows = task_rows("eval", eval_size=eval_size)
    examples = [Example(prompt=r["prompt"], columns={"answer": r["answer"]}) for r in rows]
    prompt_ids = [render_prompt(tokenizer, ex, None, True) for ex in examples]
    texts = [r["prompt"][0]["content"] for r in rows]
    generator = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id, batch_size=32)
    rewards = [RewardFn("answer", answer_reward, 1.0, {})]

    def accuracy(policy) -> float:
        return evaluate(policy, Completions(generator, rewards), examples, prompt_ids, texts,
                        SamplingParams(max_new_tokens=max_new_tokens, greedy=True), 32)[0]["accuracy"]

    scores = {"base": accuracy(load_base_model(ModelConfig(path=folder), folder))}
    for name, path in adapters.items():
        scores[name] = accuracy(PeftModel.from_pretrained(load_base_model(ModelConfig(path=folder), folder), path))
    return scores
