"""The GRPO recipe, top to bottom: prepare everything (validating before any model loads), then
for each step: sample -> score -> advantages -> reference/old log-probs -> update(s) -> log."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlora.algos.registry import Algorithm, get_algorithm
from rlora.config import RLConfig, to_yaml
from rlora.data.prompts import PromptSets, load_prompt_sets, prompt_text, render_prompt
from rlora.data.tasks import check_task
from rlora.errors import UserError
from rlora.logging.console import info, metrics_line, print_summary, progress_bar
from rlora.logging.sinks import Sinks, check_sinks
from rlora.machine import resolve_sampler_dtype
from rlora.models.loading import (
    TokenizerInfo, add_model_eos_ids, attach_lora, causal_lm, check_adapter_folder, load_base_model,
    load_tokenizer, quantization_config, resolve_device, resolve_model_path, save_adapter, trainable_parameters,
)
from rlora.plot import plot_after_run
from rlora.models import molora as ml
from rlora.models.frozen_prefix import first_adapter_layer, sharing_unsupported
from rlora.models.value_model import Critic, attach_critic
from rlora.rewards.reward_adapter import attach_reward_adapters, check_reward_adapters
from rlora.rewards.scoring import RewardFn, resolve_rewards
from rlora.rollout.backends import build_generator
from rlora.rollout.generator import Generator
from rlora.system import return_freed_memory
from rlora.train.distributed import (
    World, all_reduce_sums, barrier, gather_objects, on_every_rank, on_rank_zero, rank_divergence,
)
from rlora.train.evaluate import eval_sampling, evaluate, evaluate_policies
from rlora.train.fsdp import ShardedBase, ShardedSampler, check_fsdp, shard_base
from rlora.train.metrics import merge_metrics
from rlora.train.optim import build_optimizer
from rlora.train.outputs import RunDir, default_output_dir, to_json
from rlora.train.replay import ReplayBuffer
from rlora.train.checkpoint import set_aside_after
from rlora.train.resume import (
    check_replay_ranks, check_same_run, find_checkpoint, replay_state, restore_training_state, save_training_state,
)
from rlora.models.multi_lora import attach_policies
from rlora.train import policies as pol
from rlora.train.ppo_step import ppo_step
from rlora.train.step import RewardFailure, grpo_step
from rlora.types import Example


@dataclass
class Session:
    cfg: RLConfig
    run_dir: RunDir
    tokenizer: object
    tok: TokenizerInfo
    model: torch.nn.Module
    algo: Algorithm
    generator: Generator  # training rollouts
    eval_generator: Generator  # held-out evaluation: always in the model's own dtype, so accuracy is exact
    rewards: list[RewardFn]
    prompts: PromptSets
    train_ids: list[list[int]]
    eval_ids: list[list[int]]
    resume_from: Path | None = None  # checkpoint this run continues from
    world: World = World()  # data-parallel ranks (one process: rank 0 of 1)
    num_frozen: int = 0  # decoder layers below the lowest adapter layer, run once per step (0: not shared)
    critic: Critic | None = None  # PPO's value adapter + head on the same base (algo.name=ppo)
    policies: list[pol.Policy] | None = None  # several policies on the base (cfg.policies), built by _run
    sharded: ShardedBase | None = None  # train.fsdp: the base's decoder layers split across the ranks


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_world(cfg: RLConfig, world: World) -> None:
    """What data parallel needs: whole prompts per rank, no batch-wide statistics, split-invariant sampling."""
    if not world.active:
        return
    if cfg.train.prompts_per_step % world.size:
        raise UserError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the {world.size} "
                        "ranks: each rank samples whole groups")
    batch_stats = cfg.algo.adv_scale == "batch" or cfg.algo.name.startswith("reinforce_pp")
    if batch_stats and cfg.algo.dynamic_sampling:  # a rank whose groups were all dropped computes no statistics
        raise UserError("data parallel with batch-wide statistics (algo.adv_scale=batch, reinforce_pp) needs every "
                        "rank to keep its groups: disable algo.dynamic_sampling, or use group statistics")
    if cfg.rollout.engine != "builtin":
        raise UserError("data parallel needs rollout.engine=builtin (its samples do not depend on how the batch is "
                        "split across ranks)")


def check_inputs(cfg: RLConfig, world: World = World()) -> tuple[RunDir, list[RewardFn], Path | None]:
    """Everything that can be checked without loading the model, so bad input fails in a second."""
    check_world(cfg, world)
    check_fsdp(cfg, world)
    resolve_machine_settings(cfg, world)
    if cfg.train.output_dir is None:
        cfg.train.output_dir = default_output_dir("train")
    run_dir = RunDir(cfg.train.output_dir, cfg.train.overwrite, writer=world.is_main)
    resume_from = find_checkpoint(cfg)
    if resume_from is None or not run_dir.holds_checkpoint(resume_from):
        on_rank_zero(world, run_dir.check_writable)
    if resume_from is not None:
        check_same_run(cfg, resume_from)  # fail before the model loads
        if cfg.algo.replay.enabled:
            check_replay_ranks(resume_from, world.size)
    check_sinks(cfg.log)  # tensorboard / wandb missing: say so before loading anything
    if cfg.lora.init_from:
        check_adapter_folder(cfg.lora.init_from)
    return run_dir, check_data_and_rewards(cfg), resume_from


def resolve_machine_settings(cfg: RLConfig, world: World = World()) -> None:
    """`auto` settings -> what this machine runs fastest (rlora.machine), printed once; config.yaml and the
    checkpoints then hold the chosen value."""
    if cfg.rollout.sampler_dtype == "auto":
        device = resolve_device(cfg.model.device)
        chosen = "model" if cfg.rollout.engine == "hf" else resolve_sampler_dtype("auto", cfg.model.dtype, device)
        cfg.rollout.sampler_dtype = chosen
        if world.is_main:
            why = ("the device computes bf16 natively" if chosen == "bfloat16" else
                   "hf engine" if cfg.rollout.engine == "hf" else
                   f"{cfg.model.dtype} model" if cfg.model.dtype != "float32" else
                   "no native bf16 on this device: AVX512-BF16/AMX absent")
            info(f"rollout.sampler_dtype=auto -> {chosen} ({why})")


def check_data_and_rewards(cfg: RLConfig) -> list[RewardFn]:
    """The task or data files, the model's quantization needs and the reward functions, before any model loads."""
    if cfg.data.task is not None:
        check_task(cfg.data.task, cfg.data.task_args)
    for path in (cfg.data.path, cfg.data.eval_path):
        if path is not None and not Path(path).is_file():
            raise UserError(f"data file not found: {path}")
    quantization_config(cfg.model)  # bitsandbytes missing: say so before loading anything
    resolve_device(cfg.model.device)  # a GPU asked for but absent: say so before loading anything
    if cfg.data.task == "humaneval" and any(spec.fn == "gym" for spec in cfg.rewards):
        raise UserError("task 'humaneval' is scored by running its tests: use rewards: [{fn: code}] instead of gym")
    rewards = resolve_rewards(cfg.rewards, has_task=cfg.data.task is not None)
    check_reward_adapters(rewards, cfg.model.path)
    return rewards


def prepare(cfg: RLConfig, world: World = World()) -> Session:
    run_dir, rewards, resume_from = check_inputs(cfg, world)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    prompts = load_prompt_sets(cfg.data)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer, tok = load_tokenizer(model_path, cfg.model.trust_remote_code)
    base = load_base_model(cfg.model, model_path, place=not cfg.train.fsdp)  # fsdp: placed layer by layer
    add_model_eos_ids(tok, base)
    model = attach_policy(base, cfg)
    num_frozen = frozen_layers_to_share(cfg, model)  # the policy's layers: a reward adapter is active only to score
    model = attach_reward_adapters(rewards, model, tokenizer, tok, cfg, prompts)  # beside the policy's, frozen
    critic = None
    if get_algorithm(cfg.algo.name).critic:  # beside the policy's, on its layers: frozen outside Critic.active()
        critic = attach_critic(model, cfg.ppo.value_rank or cfg.lora.rank, cfg.ppo.value_alpha or cfg.lora.alpha,
                               cfg.ppo.value_head_init_std)
    if cfg.train.gradient_checkpointing:  # active only in train mode: sampling and no-grad passes skip it
        causal_lm(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    sharded = shard_base(model, world, resolve_device(cfg.model.device), cfg.train.fsdp_gather) if cfg.train.fsdp else None

    def ids(examples: list[Example]) -> list[list[int]]:
        return [render_prompt(tokenizer, ex, cfg.data.system_prompt, cfg.data.use_chat_template) for ex in examples]

    train_ids, eval_ids = ids(prompts.train), ids(prompts.eval)
    longest = max(len(p) for p in train_ids + eval_ids) + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)
    generator = build_generator(cfg.rollout, model, tokenizer, tok.eos_ids, tok.pad_id, longest, cfg.eval.batch_size)
    eval_generator = generator
    if cfg.rollout.sampler_dtype != "model":
        exact = cfg.rollout.model_copy(update={"sampler_dtype": "model"})
        eval_generator = build_generator(exact, model, tokenizer, tok.eos_ids, tok.pad_id, longest, cfg.eval.batch_size)
    if sharded is not None:  # the sampler reads the weights directly: every call gathers the base or streams it
        generator, eval_generator = ShardedSampler(generator, sharded), ShardedSampler(eval_generator, sharded)
        if cfg.train.fsdp_gather == "layer" and "hf" in (generator.name, eval_generator.name):
            raise UserError("train.fsdp_gather=layer streams the layers through rlora's built-in sampler, which does not "
                            "support this model (it samples with transformers generate): set train.fsdp_gather=model")
        if cfg.train.fsdp_gather == "layer" and cfg.rollout.merge_adapter:
            info("train.fsdp_gather=layer with rollout.merge_adapter=true merges the LoRA into every layer in every "
                 "decode step: rollout.merge_adapter=false samples faster here (docs/fsdp.md)")
    if cfg.rollout.sampler_dtype != "model" and cfg.algo.sampler_is_cap is None:
        info(f"rollout.sampler_dtype={cfg.rollout.sampler_dtype} without algo.sampler_is_cap: samples are slightly "
             "off-policy and nothing corrects for it (watch sampler_logp_gap)")
    # the config rejects these with engine=hf; here the builtin engine fell back to hf for this model
    for wanted, option, fix in ((cfg.algo.sampler_is_cap is not None, "algo.sampler_is_cap", "unset it"),
                                (cfg.algo.replay.enabled, "algo.replay", "set algo.replay.enabled=false")):
        if wanted and generator.name != "builtin":
            raise UserError(f"{option} needs the sampler's log-probs, which only rollout.engine=builtin returns "
                            f"(this run samples with '{generator.name}'): {fix}")
    return Session(cfg, run_dir, tokenizer, tok, model, get_algorithm(cfg.algo.name), generator, eval_generator, rewards,
                   prompts, train_ids, eval_ids, resume_from, world, num_frozen, critic, sharded=sharded)


def frozen_layers_to_share(cfg: RLConfig, model) -> int:
    """How many lower decoder layers the step runs once for all its log-prob passes (0: none)."""
    num_frozen = first_adapter_layer(model) if cfg.train.share_frozen_layers else 0
    if num_frozen == 0:
        return 0
    reason = sharing_unsupported(model)
    if reason is None and not cfg.train.logprob_chunk_tokens:
        reason = "train.logprob_chunk_tokens=0 (the full-logits path)"
    if reason is not None:
        info(f"train.share_frozen_layers: not for this run ({reason}); every log-prob pass runs all layers")
        return 0
    return num_frozen


def run_eval(s: Session, label: str) -> dict | None:
    """Held-out evaluation of the policy (with several policies, before training: every policy is the same
    function, so the first one stands for all)."""
    if not s.prompts.eval:
        return None
    ev = s.cfg.eval
    policy = None if s.policies is None else s.policies[0]
    texts = [prompt_text(ex) for ex in s.prompts.eval]
    with progress_bar(f"eval ({label})", len(texts)) as update:
        result, samples = evaluate(s.model, s.eval_generator, s.prompts.eval, s.eval_ids, texts, s.rewards,
                                   eval_sampling(s.cfg), ev.batch_size, ev.num_samples, tuple(ev.pass_k), ev.seed,
                                   progress=update, policy=None if policy is None else policy.index)
    return record_eval(s.run_dir, label, "", result, samples)


def record_eval(run_dir: RunDir, label: str, name: str, result: dict, samples: list[dict]) -> dict:
    """eval_{label}.jsonl in run_dir, and the line on the console."""
    run_dir.write_text(f"eval_{label}.jsonl", "".join(_jsonl(x) for x in samples))
    reward = "-" if result["reward_mean"] is None else f"{result['reward_mean']:.3f}"
    failures = f", {result['reward_failures']} reward failures" if result["reward_failures"] else ""
    info(f"held-out {label}{name}: accuracy {result['accuracy']:.3f}  reward {reward}  (n={result['n']}{failures})")
    return result


def eval_after(s: Session) -> dict | None:
    """The evaluation after training: of the policy, or {name: result} of every policy, sampled together (each
    also in its folder: eval_after.jsonl, eval.json)."""
    if s.policies is None or not s.prompts.eval:
        return run_eval(s, "after")
    ev = s.cfg.eval
    texts = [prompt_text(ex) for ex in s.prompts.eval]
    with progress_bar("eval (after, every policy)", len(texts) * len(s.policies)) as update:
        outcomes = evaluate_policies(s.model, s.eval_generator, s.prompts.eval, s.eval_ids, texts, s.rewards,
                                     eval_sampling(s.cfg), ev.batch_size, [p.index for p in s.policies], ev.num_samples,
                                     tuple(ev.pass_k), ev.seed, progress=update)
    results = {}
    for policy, (result, samples) in zip(s.policies, outcomes):
        results[policy.name] = record_eval(policy.run_dir, "after", f" {policy.name}", result, samples)
        policy.run_dir.write_json("eval.json", {"after": result})
    return results


def main_eval(s: Session, run: Callable[[], dict | None]) -> dict | None:
    """Rank 0 evaluates (run()) while the others wait; with train.fsdp every rank enters the sharded base's sampling
    scope for it (and, streaming it, takes part in rank 0's passes over the layers)."""
    with s.sharded.sampling() if s.sharded is not None else nullcontext():
        return run() if s.world.is_main else None


def _jsonl(obj) -> str:
    return to_json(obj) + "\n"


def attach_molora_policy(base, cfg: RLConfig):
    """The policy as a mixture of LoRA experts on the base (in place); the reference is the base with the mixture
    off (molora_runtime.reference_policy)."""
    ml.attach_molora(base, cfg.molora)
    info(f"molora policy: {cfg.molora.num_experts} experts, top {cfg.molora.top_k}, {cfg.molora.router} router, "
         f"{len(ml.molora_modules(base))} modules")
    return base


def attach_policy(base, cfg: RLConfig):
    """The trainable policy on the base: a LoRA adapter, a mixture of LoRA experts, or several named adapters."""
    if cfg.molora is not None:
        return attach_molora_policy(base, cfg)
    if cfg.policies is not None:
        model = attach_policies(base, cfg.lora, *pol.names_and_seeds(cfg))
        info(f"{len(cfg.policies)} policies on one base: {', '.join(p.name for p in cfg.policies)}")
        return model
    return attach_lora(base, cfg.lora)


def save_final(s: Session, name: str = "adapter") -> None:
    """The policy: a PEFT adapter folder, a MoLoRA folder (docs/molora.md), or one PEFT folder per policy."""
    if s.policies is not None:
        pol.save_adapters(s.model, s.policies, name)
        return
    save = save_adapter if s.cfg.molora is None else ml.save_molora
    s.run_dir.write_folder(name, lambda folder: save(s.model, folder))
    if s.critic is not None:  # adapter -> value_model, adapter-stepN -> value_model-stepN
        s.run_dir.write_folder(name.replace("adapter", "value_model"), s.critic.save)


def optimizer_groups(s: Session) -> list[dict]:
    """The policy's adapter parameters; with a critic, its adapter and head as a second group (ppo.value_lr)."""
    groups = [{"params": trainable_parameters(s.model)}]
    if s.critic is not None:
        groups.append({"params": s.critic.parameters(), "lr": s.cfg.ppo.value_lr or s.cfg.train.lr})
    return groups


def start(s: Session, optimizer, scheduler, replay) -> tuple[int, float, dict]:
    """A fresh run: create the folder and evaluate before training. A resumed one: put the checkpoint's
    state back and drop log lines of steps after it. -> (first step, training time so far, evaluations)."""
    cfg = s.cfg
    if s.resume_from is None or not s.run_dir.holds_checkpoint(s.resume_from):
        s.run_dir.create()
    if s.policies is not None:
        pol.create_folders(s.policies)
    s.run_dir.write_text("config.yaml", to_yaml(cfg))
    if s.resume_from is None:
        before = main_eval(s, lambda: run_eval(s, "before")) if cfg.eval.before else None
        barrier(s.world)
        return 0, 0.0, {"before": before}
    state = check_same_run(cfg, s.resume_from)
    restore_training_state(s.resume_from, s.model, optimizer, scheduler, replay, s.critic, s.policies, s.world.size)
    for run_dir, names in [(s.run_dir, ("metrics.jsonl", "samples.jsonl"))] + [(p.run_dir, ("metrics.jsonl",))
                                                                                for p in s.policies or []]:
        run_dir.drop_steps_after(state["step"], names)
    if s.world.is_main and s.run_dir.holds_checkpoint(s.resume_from):
        for folder in set_aside_after(s.resume_from.parent, state["step"]):
            info(f"checkpoint {folder.name.removeprefix('abandoned-')} is after the resumed step: kept as {folder}")
    info(f"resuming from {s.resume_from} after step {state['step']}")
    return state["step"], state["train_s"], {"before": state["eval_before"]}


def run_grpo(cfg: RLConfig) -> dict:
    """Train; under torchrun every rank runs this, rank 0 alone writes and prints."""
    return on_every_rank(lambda world: _run(cfg, world))


def _run(cfg: RLConfig, world: World) -> dict:
    if cfg.train.release_memory and not return_freed_memory():
        info("train.release_memory has no effect here (needs glibc)")
    s = prepare(cfg, world)
    n_trainable = sum(p.numel() for p in trainable_parameters(s.model))
    critic = f" (+ {sum(p.numel() for p in s.critic.parameters()):,} in the critic)" if s.critic is not None else ""
    info(f"rlora train: {cfg.model.path}, {n_trainable:,} adapter parameters{critic}, {len(s.train_ids)} prompts "
         f"-> {cfg.train.output_dir}")
    optimizer = scheduler = None  # several policies: one of each per policy (s.policies)
    if cfg.policies is not None:
        s.policies = pol.build_policies(cfg, s.model, s.run_dir.path, world.is_main)
    else:
        optimizer, scheduler = build_optimizer(optimizer_groups(s), cfg.train, cfg.train.steps * cfg.algo.num_iterations)
    replay = ReplayBuffer(cfg.algo.replay, cfg.train.seed, world.rank) if cfg.algo.replay.enabled else None
    first_step, train_s_before, evals = start(s, optimizer, scheduler, replay)
    sinks = Sinks(cfg, s.run_dir, first_step)  # TensorBoard, W&B, completions table (log.*)
    t0, last, status = time.perf_counter() - train_s_before, {}, "completed"

    def checkpoint(done: int) -> None:
        buffers = None if replay is None else gather_objects(world, replay_state(replay))  # every rank's
        cause = None
        if world.is_main:
            try:
                save_training_state(s.run_dir.path, done, cfg, s.model, optimizer, scheduler, buffers,
                                    time.perf_counter() - t0, evals["before"], s.critic, s.policies)
            except OSError as err:  # a full disk, a lost mount: the previous checkpoint is untouched
                cause = err.strerror or str(err)
        if all_reduce_sums(world, [float(cause is not None)])[0]:  # every rank stops with the same line
            raise UserError(f"could not write the checkpoint after step {done} ({cause or 'on rank 0'}); the previous "
                            "checkpoint stays valid: fix the cause and continue with train.resume=auto")

    try:
        with progress_bar("train", cfg.train.steps) as update:
            update(first_step, "")
            for step in range(first_step, cfg.train.steps):
                last, samples = (ppo_step if s.critic is not None else grpo_step)(s, step, optimizer, scheduler, replay)
                if world.active:
                    last, samples = gather_step(world, last, samples, trainable_parameters(s.model) +
                                                ([] if s.critic is None else s.critic.parameters()))
                if s.policies is not None:
                    last, per_policy = pol.split_metrics(last, s.policies)
                    for policy in s.policies:
                        policy.run_dir.append_jsonl("metrics.jsonl", per_policy[policy.name])
                line = metrics_line(last) if s.policies is None else policies_line(last, s.policies)
                s.run_dir.append_jsonl("metrics.jsonl", last)
                sinks.log_metrics(step + 1, last)
                if cfg.train.sample_every and (step + 1) % cfg.train.sample_every == 0:
                    sinks.log_completions(step + 1, samples)
                if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0:
                    save_final(s, f"adapter-step{step + 1}")
                if cfg.train.checkpoint_every and (step + 1) % cfg.train.checkpoint_every == 0:
                    checkpoint(step + 1)
                update(step + 1, line)
                out_of_time = bool(cfg.train.max_time_s) and time.perf_counter() - t0 >= cfg.train.max_time_s
                if all_reduce_sums(world, [float(out_of_time)])[0]:  # every rank stops after the same step
                    info(f"train.max_time_s={cfg.train.max_time_s} reached after {step + 1} steps")
                    break
    except BaseException as stop:  # keep what was learnt, say why it stopped, then let the error through
        if isinstance(stop, KeyboardInterrupt):
            status = "interrupted"
        elif isinstance(stop, RewardFailure):
            status = "stopped: reward failures"
        else:
            status = f"failed: {type(stop).__name__}: {stop}"
        sinks.close(failed=True)
        try:
            save_final(s)
            s.run_dir.write_json("summary.json", {"status": status, "last_metrics": last, "eval": evals})
        except OSError as err:  # e.g. the disk is full: say so, and let the original error through
            info(f"could not save the adapter after the failure: {err}")
        raise
    sinks.close()
    save_final(s)
    done = last.get("step", first_step)
    if cfg.train.checkpoint_every and done % cfg.train.checkpoint_every:
        checkpoint(done)  # the end of the run is a checkpoint too: `train.steps=more train.resume=auto` extends it
    train_s = time.perf_counter() - t0
    evals["after"] = main_eval(s, lambda: eval_after(s)) if cfg.eval.after else None
    barrier(world)
    if any(evals.values()):
        s.run_dir.write_json("eval.json", evals)
    summary = {"status": status, "steps": done, "train_s": train_s, "adapter_params": n_trainable, "last_metrics": last, "eval": evals}
    s.run_dir.write_json("summary.json", summary)
    if cfg.log.plot and world.is_main:  # several policies: their curves overlaid
        plot_after_run(s.run_dir.path, None if s.policies is None else [p.run_dir.path for p in s.policies])
    _print_final(s, summary)
    return summary


def gather_step(world: World, metrics: dict, samples: list[dict], params) -> tuple[dict, list[dict]]:
    """Every rank's metrics merged (each by its reduction, train/metrics.py) and samples joined,
    with the check that all ranks hold the same adapter."""
    gathered = gather_objects(world, (metrics, samples))
    merged = merge_metrics([m for m, _ in gathered])
    merged |= {"world_size": world.size, "adapter_rank_divergence": rank_divergence(world, params)}
    return merged, [row for _, rows in gathered for row in rows]


def policies_line(flat: dict, policies: list[pol.Policy]) -> str:
    """The progress line of a step of several policies (flat metrics): each one's mean reward, the step time."""
    rewards = "  ".join(f"{p.name} {'-' if flat.get(f'{p.name}/reward_mean') is None else format(flat[f'{p.name}/reward_mean'], '.3f')}"
                        for p in policies)
    return f"reward {rewards}  {flat['step_s']:.1f}s/step"


def _print_final(s: Session, summary: dict) -> None:
    rows = [("output", str(s.run_dir.path)), ("steps", str(summary["steps"])),
            ("train time", f"{summary['train_s']:.1f} s")]
    last = summary["last_metrics"]
    if last:
        rows.append(("last step", metrics_line(last) if s.policies is None else policies_line(last, s.policies)))
    for label in ("before", "after"):
        result = summary["eval"].get(label)
        per_policy = result if s.policies is not None and label == "after" and result else {"": result}
        for name, one in per_policy.items():
            if one:
                rows.append((f"held-out accuracy {label}{' ' + name if name else ''}", f"{one['accuracy']:.3f} (n={one['n']})"))
    print_summary("rlora train: done", rows)
