"""A training run's session: everything `rlora train` checks and builds before its first step.

check_inputs validates what can be validated before any model loads (output folder, resume, world,
rewards, data), so bad input fails in a second; prepare() then loads the base, attaches the policy (one
LoRA, several policies, or MoLoRA), reward adapters and the critic, builds the samplers, and returns the
Session the recipe (train/grpo.py) and the steps (train/step.py, train/ppo_step.py) work on."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple
from pathlib import Path

import numpy as np
import torch

from rlora.algos.registry import Algorithm, get_algorithm
from rlora.config import RLConfig, apply_presets, check_config, check_init_from_keys, check_launch, init_from_dropout
from rlora.data.files import check_data_file
from rlora.data.prompts import PromptSets, check_answers, held_out_notice, load_prompt_sets, prompt_text, render_prompt
from rlora.data.tasks import check_task
from rlora.envs.registry import EnvFactory, env_factory
from rlora.errors import UserError
from rlora.logging.console import info
from rlora.train.sinks import check_sinks
from rlora.train.sources import RolloutSource, check_context, episode_renderer, longest_context, rollout_source
from rlora.machine import fast_fp16_weights, native_half
from rlora.models import expert_lora
from rlora.models import molora as ml
from rlora.models.adapters import PolicyAdapter, adapter_of
from rlora.models.dropouts import base_dropouts, no_adapter_dropout
from rlora.models.frozen_prefix import first_adapter_layer, sharing_unsupported
from rlora.models.loading import (
    TokenizerInfo, add_model_eos_ids, attach_lora, causal_lm, check_adapter_folder, check_lora_targets,
    load_base_model, load_tokenizer, max_positions, model_device, quantization_config,
    resolve_device, resolve_model_path,
)
from rlora.models.molora_runtime import checkpoint_kwargs
from rlora.models.multi_lora import PEFT_NAME, attach_policies
from rlora.models.packed_groups import set_group_packing
from rlora.models.shared_prompts import set_prompt_sharing
from rlora.models.value_model import ADAPTER as CRITIC_ADAPTER, Critic, attach_critic
from rlora.rewards.reward_adapter import RewardAdapter, attach_reward_adapters, check_reward_adapters
from rlora.rewards.builtin import ANSWER_FORMS, BUILTIN_REWARDS
from rlora.rewards.scoring import RewardFn, resolve_rewards
from rlora.rollout.backends import build_generator
from rlora.rollout.generator import Generator
from rlora.train import policies as pol
from rlora.train.distributed import World, gather_objects, on_rank_zero
from rlora.train.fsdp import ShardedBase, shard_base, sharded_samplers, step_sampling_scope
from rlora.train.outputs import RunDir, default_output_dir
from rlora.train.resume import (
    check_fresh_folder, check_replay_ranks, check_resume_target, check_same_run, find_checkpoint, saved_setting,
)
from rlora.types import Example


@dataclass(frozen=True)
class Session:
    """Everything the steps of `rlora train` use, built once by prepare() (frozen: no step swaps a part of it)."""

    cfg: RLConfig
    run_dir: RunDir
    tokenizer: object
    tok: TokenizerInfo
    model: torch.nn.Module
    adapter: PolicyAdapter  # the trainable policy (or policies) on the model: the steps ask it, not the kind
    policies: list[pol.Policy]  # K >= 1, each with its optimizer (a plain run: one, 'default'; train/policies.py)
    algo: Algorithm
    generator: Generator  # training rollouts
    eval_generator: Generator  # held-out evaluation: always in the model's own dtype, so accuracy is exact
    rewards: list[RewardFn]
    source: RolloutSource  # turns prompts into scored rows: completions, or episodes with an environment (env)
    eval_source: RolloutSource  # the same through eval_generator
    prompts: PromptSets
    train_ids: list[list[int]]
    eval_ids: list[list[int]]
    resume_from: Path | None = None  # checkpoint this run continues from
    world: World = World()  # data-parallel ranks (one process: rank 0 of 1)
    num_frozen: int = 0  # decoder layers below the lowest adapter layer, run once per step (0: not shared)
    critics: list[Critic] = field(default_factory=list)  # PPO: each policy's value adapter + head; else none
    sharded: ShardedBase | None = None  # train.fsdp: the base's decoder layers split across the ranks
    sampling_scope: Callable[[], AbstractContextManager] = nullcontext  # around a step's sampling (train/fsdp.py)

    @property
    def device(self) -> torch.device:
        """The model's device: where a step's rollout tensors live from sampling to the update."""
        return model_device(self.model)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class CheckedInputs(NamedTuple):
    run_dir: RunDir
    rewards: list[RewardFn]
    resume_from: Path | None
    make_env: EnvFactory | None
    notices: list[str]  # what `auto` chose, a missing held-out set: printed once the last input check has passed


def check_inputs(cfg: RLConfig, world: World = World()) -> CheckedInputs:
    """Everything that can be checked without loading the model, so bad input fails in a second."""
    # load_config did the first two; a config built in Python (RLConfig(...)) gets them here (both are idempotent)
    apply_presets(cfg)
    check_config(cfg)
    check_launch(cfg, world.size)  # the refusal table's rows that read the number of ranks
    check_resume_target(cfg)  # before a default folder is chosen
    if cfg.train.output_dir is None:
        cfg.train.output_dir = default_output_dir("train")
    run_dir = RunDir(cfg.train.output_dir, cfg.train.overwrite, writer=world.is_main)
    resume_from = find_checkpoint(cfg)
    if resume_from is None or not run_dir.holds_checkpoint(resume_from):
        on_rank_zero(world, lambda: check_fresh_folder(cfg, run_dir))
    check_sinks(cfg.log)  # tensorboard / wandb missing: say so before loading anything
    if cfg.lora.init_from:
        check_adapter_folder(cfg.lora.init_from)
        check_init_from_keys(cfg.lora)
    rewards = check_data_and_rewards(cfg)
    make_env = env_factory(cfg.env) if cfg.env is not None else None  # a bad env fails before the model loads
    # eval.before/after with no held-out prompts: train/grpo.py skips them, the notice says why
    notices = [notice] if (cfg.eval.before or cfg.eval.after) and (notice := held_out_notice(cfg.data)) else []
    notices += resolve_machine_settings(cfg, world, resume_from, announce=False)
    if resume_from is not None:
        check_same_run(cfg, resume_from)  # fail before the model loads (the resolved settings compared too)
        if cfg.algo.replay.enabled:
            check_replay_ranks(resume_from, world.size)
    return CheckedInputs(run_dir, rewards, resume_from, make_env, notices)


def resolve_machine_settings(cfg: RLConfig, world: World = World(), resume_from: Path | None = None,
                             announce: bool = True) -> list[str]:
    """`auto` settings -> what this machine runs fastest (rlora.machine); config.yaml and the checkpoints then hold
    the chosen value. A resumed run keeps its checkpoint's choice (the samples depend on it), and rank 0 decides for
    every rank (ranks on other CPUs must still sample alike). -> the lines that say what was chosen (rank 0's;
    printed now if announce, else by the caller once its input checks have passed)."""
    notices = [line for line in [_resolve_autocast(cfg, world, resume_from), _resolve_merge(cfg, resume_from)] if line]
    if announce and world.is_main:
        for line in notices:
            info(line)
    if cfg.rollout.sampler_dtype != "auto":
        return notices
    if resume_from is not None:
        # every checkpoint's config names its sampler dtype (the key predates `auto`, which it never holds)
        chosen, why = saved_setting(resume_from, "rollout", "sampler_dtype") or "model", "the checkpoint's"
    elif cfg.rollout.engine == "hf":
        chosen, why = "model", "hf engine"
    elif cfg.model.dtype != "float32":
        chosen, why = "model", f"a {cfg.model.dtype} model"
    else:
        chosen, why = _fastest_sampler(cfg, resolve_device(cfg.model.device))
    chosen, why = gather_objects(world, (chosen, why))[0]
    cfg.rollout.sampler_dtype = chosen
    line = f"rollout.sampler_dtype=auto -> {chosen} ({why})"
    if announce and world.is_main:
        info(line)
    return notices + ([line] if world.is_main else [])


def _resolve_merge(cfg: RLConfig, resume_from: Path | None) -> str | None:
    """rollout.merge_adapter=auto -> false where the sampler streams a sharded base's layers (train.fsdp_gather=layer:
    a merged adapter is merged again into every layer in every decode step; unmerged sampling is 1.45x faster,
    docs/fsdp.md), else true; a resumed run keeps its checkpoint's (its samples depend on it; a run before the key:
    true). Said only where it chose false. The same on every rank: it reads the config alone."""
    if cfg.rollout.merge_adapter != "auto":
        return None
    if resume_from is not None:
        saved = saved_setting(resume_from, "rollout", "merge_adapter")
        cfg.rollout.merge_adapter = saved if isinstance(saved, bool) else True
    else:
        cfg.rollout.merge_adapter = not (cfg.train.fsdp and cfg.train.fsdp_gather == "layer")
    if cfg.rollout.merge_adapter:
        return None
    why = "the checkpoint's" if resume_from is not None else "train.fsdp_gather=layer: merging again in every decode step"
    return f"rollout.merge_adapter=auto -> false ({why})"


def _resolve_autocast(cfg: RLConfig, world: World, resume_from: Path | None) -> str | None:
    """train.autocast=auto -> bfloat16 for a bfloat16 model where the device computes bf16 natively (elsewhere bf16
    arithmetic is emulated: slower), else off; a resumed run keeps its checkpoint's (a run before the key: off)."""
    if cfg.train.autocast != "auto":
        return None
    if resume_from is not None:
        chosen, why = saved_setting(resume_from, "train", "autocast") or "off", "the checkpoint's"
    elif cfg.model.dtype != "bfloat16":
        chosen, why = "off", f"a {cfg.model.dtype} model"
    elif cfg.train.fsdp:
        chosen, why = "off", "train.fsdp"
    elif native_half(resolve_device(cfg.model.device), "bfloat16"):
        chosen, why = "bfloat16", "a bfloat16 model on a device that computes bf16 natively"
    else:
        chosen, why = "off", "no native bf16 on this device (AVX512-BF16/AMX absent, or a GPU before Ampere)"
    chosen, why = gather_objects(world, (chosen, why))[0]
    cfg.train.autocast = chosen
    # a float32/float16 model leaves nothing to decide: say so only where the choice depended on the device or run
    if world.is_main and (cfg.model.dtype == "bfloat16" or resume_from is not None):
        return f"train.autocast=auto -> {chosen} ({why})"
    return None


def _fastest_sampler(cfg: RLConfig, device) -> tuple[str, str]:
    """(sampler_dtype, why) for a float32 model on the builtin engine: a lower precision only where the device runs
    it faster (rlora.machine) and algo.sampler_is_cap corrects for the small difference it makes."""
    if native_half(device, "bfloat16"):
        faster, how = "bfloat16", "the device computes bf16 natively"
    elif fast_fp16_weights(device) and cfg.rollout.merge_adapter and not cfg.train.fsdp:
        # not with merge_adapter=false (the exact adapter layers) nor a sharded base (gathered anew: repacked each call)
        faster, how = "float16_weights", "x86 CPU without native bf16: float32 compute from float16 weight copies"
    else:
        return "model", "no native bf16 on this device (AVX512-BF16/AMX absent, or a GPU before Ampere)"
    if cfg.algo.sampler_is_cap is None:
        return "model", (f"rollout.sampler_dtype={faster} would be faster ({how}): set algo.sampler_is_cap, e.g. 2.0, "
                         "to sample with it and correct the small difference by importance weights")
    return faster, f"{how}; algo.sampler_is_cap corrects for it"


def check_data_and_rewards(cfg: RLConfig) -> list[RewardFn]:
    """The task or data files, the model's quantization needs and the reward functions, before any model loads."""
    if cfg.data.task is not None:
        check_task(cfg.data.task, cfg.data.task_args)
    for path in (cfg.data.path, cfg.data.eval_path):
        if path is not None:
            check_data_file(path)
    quantization_config(cfg.model)  # bitsandbytes missing: say so before loading anything
    resolve_device(cfg.model.device)  # a GPU asked for but absent: say so before loading anything
    if cfg.data.task == "humaneval" and any(spec.fn == "gym" for spec in cfg.rewards):
        raise UserError("task 'humaneval' is scored by running its tests: use rewards: [{fn: code}] instead of gym")
    rewards = resolve_rewards(cfg.rewards, has_task=cfg.data.task is not None)
    check_reward_adapters(rewards, cfg.model.path)
    return rewards


def check_rows_answered(cfg: RLConfig, prompts: PromptSets) -> None:
    """A built-in reward that requires the `answer` column (math) fails every sample of a row without one, at its
    step: a data file's such rows are refused as the prompts load, before the model does. Other rewards (format, a
    user's function) may not use the answer at all."""
    needs_answer = [spec.fn for spec in cfg.rewards if spec.fn in BUILTIN_REWARDS and _requires(BUILTIN_REWARDS[spec.fn], "answer")]
    if cfg.data.path is not None and needs_answer:
        check_answers(prompts, cfg.data, needs_answer[0])
    for reward in dict.fromkeys(spec.fn for spec in cfg.rewards if spec.fn in ANSWER_FORMS):
        _check_answer_form(cfg, prompts, reward)


def _check_answer_form(cfg: RLConfig, prompts: PromptSets, reward: str) -> None:
    """A built-in that scores against the answer's value (`closeness`: a completion's distance from a number) fails
    every sample of a row whose answer lacks that form (a word, a list, a program) at its step, so the first such
    row is named now, of a data file or a task."""
    parse, form = ANSWER_FORMS[reward]
    if cfg.data.task is not None:
        sources = ((f"task '{cfg.data.task}', training problem", prompts.train),
                   (f"task '{cfg.data.task}', held-out problem", prompts.eval))
    else:
        sources = ((f"data file {cfg.data.path}, row", prompts.train), (f"data file {cfg.data.eval_path}, row", prompts.eval))
    for where, examples in sources:
        for number, example in enumerate(examples, start=1):
            answer = example.columns.get("answer")
            if parse(str(answer)) is None:
                # a task's problems are numbered after the held-out ones left, so its prompt says which one it is
                prompt = f" ({prompt_text(example)[-60:]!r})" if cfg.data.task is not None else ""
                raise UserError(f"{where} {number}{prompt}: answer {str(answer)[:60]!r} is not {form}, but reward "
                                f"'{reward}' scores completions against its value: use {reward} only where every "
                                "answer has that form")


def _requires(fn, name: str) -> bool:
    parameter = inspect.signature(fn).parameters.get(name)
    return parameter is not None and parameter.default is inspect.Parameter.empty


def prepare(cfg: RLConfig, world: World = World()) -> Session:
    run_dir, rewards, resume_from, make_env, notices = check_inputs(cfg, world)
    model_path = resolve_model_path(cfg.model.path)  # a typo or an unreachable hub: before the notices too
    if cfg.molora is not None:  # a target module's typo: from the model's config, before any data or weight loads
        ml.check_molora_targets(cfg.molora, model_path, cfg.model.trust_remote_code)
    else:
        check_lora_targets(cfg.lora, model_path, cfg.model.trust_remote_code)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    prompts = load_prompt_sets(cfg.data)
    check_rows_answered(cfg, prompts)
    tokenizer, tok = load_tokenizer(model_path, cfg.model.trust_remote_code)
    renderer = episode_renderer(tokenizer, make_env) if make_env is not None else None  # before the model loads

    def ids(examples: list[Example]) -> list[list[int]]:
        return [render_prompt(tokenizer, ex, cfg.data.system_prompt, cfg.data.use_chat_template) for ex in examples]

    train_ids, eval_ids = ids(prompts.train), ids(prompts.eval)
    check_context(cfg, renderer, train_ids + eval_ids, max_positions(model_path, cfg.model.trust_remote_code))
    # The sampler and every no-grad pass run without dropout: an update with the base's own dropout would compute
    # another function, and each importance ratio would measure the dropout noise. The same for the adapter's: a set
    # lora.dropout is refused (config/refusals.py), and a starting adapter's own rate is turned off below.
    dropouts = base_dropouts(model_path, cfg.model.trust_remote_code)
    if dropouts:
        rates = ", ".join(f"{key}={rate:g}" for key, rate in dropouts.items())
        notices.append(f"model: the base's dropout ({rates}) is off in training, as in sampling: the update's "
                       "log-probs are the sampler's function")
    if (adapter_dropout := init_from_dropout(cfg.lora)) > 0:
        notices.append(f"lora.init_from: the adapter's lora_dropout ({adapter_dropout:g}) is off in training, as in "
                       "sampling: the update's log-probs are the sampler's function")
    for line in notices if world.is_main else []:  # every input check has passed: say what `auto` chose
        info(line)
    base = load_base_model(cfg.model, model_path, place=not cfg.train.fsdp, no_dropout=True)  # fsdp: placed later
    # the run's device: where the base is, or (fsdp) where shard_base puts it. The value and reward heads are made
    # there, not on the model's device: they sit beside the model, so shard_base would leave them on the CPU
    device = resolve_device(cfg.model.device)
    add_model_eos_ids(tok, base)
    model = attach_policy(base, cfg)
    no_adapter_dropout(model)  # a starting adapter's (lora.init_from); a set lora.dropout was refused
    num_frozen = frozen_layers_to_share(cfg, model)  # the policy's layers: a reward adapter is active only to score
    set_prompt_sharing(model, cfg.train.share_prompts)
    set_group_packing(model, cfg.train.pack_groups)
    model = attach_reward_adapters(rewards, model, tokenizer, tok, cfg, prompts, device=device)  # beside the policy's
    model, critics = attach_critics(cfg, model, device) if get_algorithm(cfg.algo.name).critic else (model, [])
    expert_lora.install(model)  # the experts wrappers that value adapters (critics) made after the policy's
    if cfg.train.gradient_checkpointing:  # active only in train mode: sampling and no-grad passes skip it
        causal_lm(model).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, **checkpoint_kwargs(model)})  # MoLoRA: its routing
    model.train()
    sharded = shard_base(model, world, device, cfg.train.fsdp_gather) if cfg.train.fsdp else None

    longest = longest_context(cfg, renderer, train_ids + eval_ids)
    generator = build_generator(cfg.rollout, model, tokenizer, tok.eos_ids, tok.pad_id, longest, cfg.eval.batch_size)
    eval_generator = generator
    if cfg.rollout.sampler_dtype != "model" and generator.name == "builtin":  # evaluations sample exactly
        exact = cfg.rollout.model_copy(update={"sampler_dtype": "model"})
        # its float32 packs only while it samples: the rollouts' packs (another dtype) are held through the run already
        eval_generator = build_generator(exact, model, tokenizer, tok.eos_ids, tok.pad_id, longest, cfg.eval.batch_size,
                                         keep_packs=False)
    if sharded is not None:  # the sampler reads the weights directly: every call gathers the base or streams it
        generator, eval_generator = sharded_samplers(generator, eval_generator, sharded, cfg)
    if cfg.rollout.sampler_dtype != "model" and cfg.algo.sampler_is_cap is None and generator.name == "builtin":
        info(f"rollout.sampler_dtype={cfg.rollout.sampler_dtype} without algo.sampler_is_cap: samples are slightly "
             "off-policy and nothing corrects for it (watch sampler_logp_gap)")
    adapter = adapter_of(model)  # of the model that holds everything (reward adapters may wrap a MoLoRA base)
    # PPO: each policy's critic trains with its optimizer, as a second parameter group with its own learning rate
    specs = cfg.policies or [None]
    critic_groups = [{"params": critic.parameters(), "lr": cfg.ppo.value_lr or (spec and spec.lr) or cfg.train.lr}
                     for critic, spec in zip(critics, specs)] or None
    policies = pol.build_policies(cfg, adapter, run_dir, critic_groups)
    source = rollout_source(cfg, generator, tok, rewards, make_env, renderer)
    eval_source = rollout_source(cfg, eval_generator, tok, rewards, make_env, renderer)  # main_eval holds the scope
    # episodes take their own turns on each rank, adaptive resamples each rank's failing groups, dynamic sampling
    # draws more prompts where a rank has too few informative groups. A reward adapter scores through the layers'
    # forward: inside the scope the base is gathered once for sampling and scoring (fsdp_gather=model, the only
    # mode it runs in) and the forward makes no collective, instead of all-gathering every layer per scoring pass
    scope = step_sampling_scope(sharded, make_env is not None or cfg.algo.adaptive.enabled or cfg.algo.dynamic_sampling
                                or any(isinstance(reward.fn, RewardAdapter) for reward in rewards))
    return Session(cfg, run_dir, tokenizer, tok, model, adapter, policies, get_algorithm(cfg.algo.name), generator,
                   eval_generator, rewards, source, eval_source, prompts, train_ids, eval_ids, resume_from, world, num_frozen, critics, sharded,
                   scope)


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


def attach_molora_policy(base, cfg: RLConfig):
    """The policy as a mixture of LoRA experts on the base (in place); the reference is the base with the mixture
    off (models/adapters.py MoLoRA.disabled)."""
    ml.attach_molora(base, cfg.molora)
    info(f"molora policy: {cfg.molora.num_experts} experts, top {cfg.molora.top_k}, {cfg.molora.router} router, "
         f"{len(ml.molora_modules(base))} modules")
    return base


CRITIC_SEED_OFFSET = 7919  # a critic is made from its policy's seed + this


def attach_critics(cfg: RLConfig, model, device: torch.device) -> tuple[torch.nn.Module, list[Critic]]:
    """PPO: a critic per policy beside the policies, on their layers (frozen outside Critic.active()), each made from
    its policy's seed (+ CRITIC_SEED_OFFSET), so that it starts as the critic of a run of that policy alone. Its head
    goes to `device`, the run's (train.fsdp: the model is still on the CPU here). -> (the model that holds them all:
    a new peft model around a MoLoRA policy's, else `model`; the critics)."""
    names, seeds = pol.names_and_seeds(cfg) if cfg.policies is not None else ([None], [cfg.train.seed])
    like = "default" if cfg.policies is None else PEFT_NAME.format(names[0])  # the policies' one LoRA placement
    # the value adapter's size where ppo.value_rank / value_alpha leave it: the policy's (a mixture's: one expert's)
    policy_lora = cfg.molora if cfg.molora is not None else cfg.lora
    critics = []
    for name, seed in zip(names, seeds):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run's stream untouched
            # not the policy's own seed: the value adapter's lora_A would then be a copy of the policy's
            torch.manual_seed(seed + CRITIC_SEED_OFFSET)
            critics.append(attach_critic(model, cfg.ppo.value_rank or policy_lora.rank,
                                         cfg.ppo.value_alpha or policy_lora.alpha, cfg.ppo.value_head_init_std,
                                         CRITIC_ADAPTER if name is None else f"value_{name}", like, device))
            model = critics[-1].model
    return model, critics


def attach_policy(base, cfg: RLConfig):
    """The trainable policy on the base: a LoRA adapter, a mixture of LoRA experts, or several named adapters."""
    if cfg.molora is not None:
        return attach_molora_policy(base, cfg)
    if cfg.policies is not None:
        model = attach_policies(base, cfg.lora, *pol.names_and_seeds(cfg))
        info(f"{len(cfg.policies)} policies on one base: {', '.join(p.name for p in cfg.policies)}")
        return model
    return attach_lora(base, cfg.lora)
