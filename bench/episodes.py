"""Sampling episodes of several turns: each later turn continued from the episode's key/value cache (the built-in
engine's sample_continued) against running the whole history again (what a sampler without it does), side by
side in one process, alternating, medians over repeats. The two give the same tokens (tests/test_envs_episodes.py);
this measures the time.

    .venv/bin/python bench/episodes.py [--adapter FOLDER] [--prompts 4] [--generations 8] [--repeats 3] [key=value ...]

Defaults: SmolLM2-135M-Instruct with the calculator environment of configs/calculator_tool.yaml, its held-out
chain_sum problems; --adapter: e.g. the warm-up adapter (runs/calculator_tool/sft/adapter), so that episodes
call the tool and take several turns (the base model answers in one turn).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from rlora.logging.console import quiet_libraries
from rlora.config import load_config
from rlora.data.prompts import held_out_task_examples
from rlora.envs.episodes import EpisodeLimits, EpisodeRunner
from rlora.envs.registry import env_factory
from rlora.models.loading import add_model_eos_ids, load_base_model, load_tokenizer, resolve_model_path
from rlora.rollout.engine import BuiltinGenerator
from rlora.train.sources import episode_renderer
from rlora.types import SamplingParams


class HistoryAgain:
    """The built-in engine without sample_continued: every turn runs the episode's whole history."""

    name = "builtin"

    def __init__(self, engine: BuiltinGenerator):
        self.engine = engine

    def sample(self, *args, **kwargs):
        return self.engine.sample(*args, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/calculator_tool.yaml")
    parser.add_argument("--adapter", default=None, help="a PEFT adapter folder on the base (default: the base)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args()
    quiet_libraries()
    cfg = load_config(args.config, ["lora.init_from=null", *args.overrides])
    path = resolve_model_path(cfg.model.path)
    tokenizer, tok = load_tokenizer(path)
    model = load_base_model(cfg.model, path)
    add_model_eos_ids(tok, model)
    if args.adapter:
        from peft import PeftModel  # only with --adapter

        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    make_env = env_factory(cfg.env)
    renderer = episode_renderer(tokenizer, make_env)
    limits = EpisodeLimits(cfg.env.max_turns, cfg.env.max_total_tokens, cfg.env.step_timeout_s)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    runners = {"continued": EpisodeRunner(engine, renderer, tok.eos_ids, tok.pad_id, limits),
               "history": EpisodeRunner(HistoryAgain(engine), renderer, tok.eos_ids, tok.pad_id, limits)}
    examples = held_out_task_examples(cfg.data)[:args.prompts]
    rows = [{"prompt": ex.prompt, **ex.columns} for ex in examples]
    params = [SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature)] * len(rows)
    times: dict[str, list[float]] = {name: [] for name in runners}
    turns = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, runner in runners.items():
            start = time.perf_counter()
            batch = runner.run(model, make_env, rows, args.generations, params, [repeat] * len(rows), list(range(len(rows))))
            if repeat:
                times[name].append(time.perf_counter() - start)
            turns[name] = sum(ep.turns for ep in batch.episodes) / len(batch.episodes)
    print(f"# episodes: {cfg.model.path}{' + ' + args.adapter if args.adapter else ''}, {len(rows)} prompts x "
          f"{args.generations}, env {cfg.env.fn}, max_turns {cfg.env.max_turns}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; medians of {args.repeats}")
    for name, values in times.items():
        print(f"{name:<10} {statistics.median(values):8.2f} s   (runs {', '.join(f'{v:.2f}' for v in values)}; "
              f"turns/episode {turns[name]:.2f})")
    print(f"continued / history: {statistics.median(times['continued']) / statistics.median(times['history']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
