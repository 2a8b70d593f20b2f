"""`rlora eval`: the base model and any number of adapters, side by side, on the held-out prompts of a
config (its data, reward functions and eval.* sampling settings), through rlora's sampler.

All adapters are loaded onto one copy of the base (peft named adapters), and so are the reward adapters of
`fn: reward_model` rewards (switched on only to score); the base itself is evaluated with the adapters
switched off. Each candidate is sampled with the same seed, so differences come from the
weights, not the draws. Outputs (written atomically): eval.json (metrics per candidate), samples_<name>.jsonl
(one row per completion), config.yaml (the resolved config).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rlora.config import RLConfig, RMConfig, SFTConfig, load_config, to_yaml
from rlora.data.prompts import PromptSets, load_prompt_sets, prompt_text, render_prompt
from rlora.errors import UserError
from rlora.logging.console import info, progress_bar
from rlora.models.loading import add_model_eos_ids, load_base_model, load_tokenizer, max_positions, resolve_model_path
from rlora.models.named_adapters import activated, attach_named, parse_named_adapters
from rlora.rewards.reward_adapter import attach_reward_adapters
from rlora.rollout.backends import build_generator
from rlora.envs.registry import env_factory
from rlora.train.evaluate import eval_sampling, evaluate
from rlora.train.sources import check_context, episode_renderer, longest_context, rollout_source
from rlora.train.session import check_data_and_rewards, check_rows_answered, seed_everything
from rlora.train.outputs import RunDir, check_eval_output, default_output_dir, to_json
from rlora.train.policies import POLICIES_FOLDER

BASE = "base"


@dataclass(frozen=True)
class Candidate:
    name: str
    adapter: str | None  # None: the base model, adapters off


def parse_adapters(specs: list[str]) -> list[Candidate]:
    """`--adapter [NAME=]PATH` values -> candidates (the name 'base' is the base model's)."""
    return [Candidate(name, path) for name, path in parse_named_adapters(specs, reserved=(BASE,)).items()]


def resolve_config(items: list[str]) -> tuple[RLConfig, list[str]]:
    """CONFIG.yaml or a run folder (its config.yaml), then overrides -> (config, the run's adapters as --adapter
    values: its adapter, or each policy's NAME=policies/NAME/adapter of a run of several policies; [] for a config)."""
    if items and "=" not in items[0] and Path(items[0]).is_dir():
        run = Path(items[0])
        if not (run / "config.yaml").is_file():
            raise UserError(f"'{run}' is a folder without config.yaml: give a run folder of `rlora train` or a config file")
        try:
            return load_config(str(run / "config.yaml"), items[1:]), run_adapters(run)
        except UserError:
            _refuse_other_commands_run(run)
            raise
    config_path = items[0] if items and "=" not in items[0] else None
    overrides = items[1:] if config_path else items
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise UserError(f"unexpected argument '{bad[0]}': give at most one CONFIG.yaml or run folder, then key=value "
                        "overrides")
    return load_config(config_path, overrides), []


def _refuse_other_commands_run(run: Path) -> None:
    """A run folder of rlora sft or rm fails as an RL config on a key only those commands have ('unknown config key
    data.completion_column'): say what the folder is and how to evaluate what it holds."""
    for model_cls, command in ((SFTConfig, "sft"), (RMConfig, "rm")):
        try:
            load_config(str(run / "config.yaml"), model_cls=model_cls)
        except UserError:
            continue
        if command == "sft" and (run / "model").is_dir():  # train.full_finetune: a whole model, no adapter
            raise UserError(f"'{run}' is a run of rlora sft that trained the whole model: evaluate it as a base, e.g. "
                            f"`rlora eval CONFIG.yaml model.path={run / 'model'}` (CONFIG.yaml: a config of rlora train)")
        if command == "sft":
            raise UserError(f"'{run}' is a run of rlora sft: evaluate its adapter on an RL task, e.g. `rlora eval "
                            f"CONFIG.yaml --adapter sft={run / 'adapter'}` (CONFIG.yaml: a config of rlora train)")
        raise UserError(f"'{run}' is a run of rlora rm: its reward model scores completions rather than writing them; "
                        f"evaluate policies with it as a reward: `rewards: [{{fn: reward_model, args: {{path: "
                        f"{run / 'reward_model'}}}}}]`")


def run_adapters(run: Path) -> list[str]:
    if (run / "adapter").is_dir():
        return [str(run / "adapter")]
    policies = sorted(p for p in (run / POLICIES_FOLDER).glob("*/adapter") if p.is_dir())
    return [f"{p.parent.name}={p}" for p in policies]


def _load_model(cfg: RLConfig, candidates: list[Candidate], rewards, prompt_sets: PromptSets):
    """The base with every adapter attached under its name, and the reward adapters of `fn: reward_model`
    rewards beside them (one copy of the base weights)."""
    model_path = resolve_model_path(cfg.model.path)
    tokenizer, tok = load_tokenizer(model_path, cfg.model.trust_remote_code)
    base = load_base_model(cfg.model, model_path, trains=False)
    add_model_eos_ids(tok, base)
    adapters = {c.name: c.adapter for c in candidates if c.adapter is not None}
    model = attach_named(base, adapters, cfg.model.path)
    model = attach_reward_adapters(rewards, model, tokenizer, tok, cfg, prompt_sets, batch_size=cfg.eval.batch_size)
    model.eval()
    return model, tokenizer, tok


def write_outputs(folder: Path, cfg: RLConfig, report: dict, samples: dict[str, list[dict]]) -> None:
    """All files at the end (a failed evaluation writes nothing); eval.json last, as the mark of a complete
    one. Files of an earlier evaluation in the folder are replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("samples_*.jsonl"):
        old.unlink()
    out = RunDir(str(folder))
    for name, rows in samples.items():
        out.write_text(f"samples_{name}.jsonl", "".join(to_json(row) + "\n" for row in rows))
    out.write_text("config.yaml", to_yaml(cfg))
    out.write_json("eval.json", report)


def run_eval_command(cfg: RLConfig, candidates: list[Candidate], output: str | None, overwrite: bool) -> dict:
    """Evaluate every candidate; -> {name: metrics}."""
    rewards = check_data_and_rewards(cfg)
    make_env = env_factory(cfg.env) if cfg.env is not None else None  # a bad env fails before the model loads
    folder = Path(output or default_output_dir("eval"))
    check_eval_output(folder, overwrite)
    prompt_sets = load_prompt_sets(cfg.data)
    check_rows_answered(cfg, PromptSets([], prompt_sets.eval))  # only the held-out rows are scored here
    examples = prompt_sets.eval
    if not examples:
        raise UserError("no held-out prompts to evaluate: set data.eval_path (a file) or data.eval_size > 0 (a task)")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    model, tokenizer, tok = _load_model(cfg, candidates, rewards, PromptSets([], examples))
    prompt_ids = [render_prompt(tokenizer, ex, cfg.data.system_prompt, cfg.data.use_chat_template) for ex in examples]
    params = eval_sampling(cfg)
    exact = cfg.rollout.model_copy(update={"sampler_dtype": "model"})  # evaluation samples in the model's dtype
    renderer = episode_renderer(tokenizer, make_env) if make_env is not None else None
    check_context(cfg, renderer, prompt_ids, max_positions(resolve_model_path(cfg.model.path), cfg.model.trust_remote_code))
    longest = longest_context(cfg, renderer, prompt_ids) if renderer else max(map(len, prompt_ids)) + params.max_new_tokens
    generator = build_generator(exact, model, tokenizer, tok.eos_ids, tok.pad_id, longest, cfg.eval.batch_size)
    source = rollout_source(cfg, generator, tok, rewards, make_env, renderer)
    texts = [prompt_text(ex) for ex in examples]
    ev, results, samples = cfg.eval, {}, {}
    for candidate in candidates:
        seed_everything(ev.seed)  # the same draws for every candidate (and for rewards that use randomness)
        with activated(model, None if candidate.adapter is None else candidate.name), progress_bar(f"eval {candidate.name}", len(examples)) as update:
            metrics, samples[candidate.name] = evaluate(model, source, examples, prompt_ids, texts, params, ev.batch_size,
                                                        ev.num_samples, tuple(ev.pass_k), ev.seed, progress=update)
        results[candidate.name] = {"adapter": candidate.adapter, **metrics}
    sampling = {"num_samples": ev.num_samples, "temperature": ev.temperature, "top_p": ev.top_p,
                "max_new_tokens": params.max_new_tokens, "seed": ev.seed}
    write_outputs(folder, cfg, {"model": cfg.model.path, "prompts": len(examples), "sampling": sampling,
                                "results": results}, samples)
    print_table(results, list(ev.pass_k))
    info(f"rlora eval: {len(examples)} prompts x {ev.num_samples} samples -> {folder}")
    return results


def print_table(results: dict[str, dict], pass_k: list[int]) -> None:
    """Side by side: one row per candidate, accuracy change against the base when it was evaluated."""
    base = results.get(BASE)
    table = Table(title="rlora eval")
    for column in ["model", "accuracy", *(f"pass@{k}" for k in pass_k), "reward mean", "reward failures"]:
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, m in results.items():
        delta = f" ({m['accuracy'] - base['accuracy']:+.3f})" if base is not None and name != BASE else ""
        reward = "-" if m["reward_mean"] is None else f"{m['reward_mean']:.3f}"
        table.add_row(name, f"{m['accuracy']:.3f}{delta}", *(f"{m[f'pass@{k}']:.3f}" for k in pass_k), reward,
                      str(m["reward_failures"]))
    Console().print(table)  # the result itself: on stdout (progress and notices go to stderr)
