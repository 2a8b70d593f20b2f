"""The configuration's schema: one pydantic model per section, `extra="forbid"` so a misspelt key is an error.

A section validates its own values (ranges, choices, and the few rules that hold wherever the section is
built alone: `rlora eval` builds an EvalConfig, a MoLoRA folder a MoLoRAConfig). Rules that combine sections
or depend on the launch are rows of one table, config/refusals.py; YAML, overrides and algorithm presets are
config/loading.py; the sections of `rlora sft` and `rlora rm` are config/supervised.py.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlora.presets import ALGORITHM_NAMES

if TYPE_CHECKING:
    from rlora.types import ThinkPhase


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str = Field("smollm2-135m-instruct", description="Local folder, hub id, or built-in alias")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = Field(False, description="Run model code shipped with a hub model (off unless asked)")
    quantization: Literal["none", "4bit", "8bit"] = Field(
        "none", description="Load the frozen base quantized with bitsandbytes (LoRA adapters stay in model.dtype, "
                    "MoLoRA's experts and routers in float32)")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the model runs: auto (the GPU if torch sees one, else cpu), cpu, cuda or cuda:N. Under "
        "torchrun each rank uses its LOCAL_RANK GPU")


class LoraConfig(Section):
    rank: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: str | list[str] = Field("all-linear", description="'all-linear' or module names")
    layers: list[int] | None = Field(None, description="Indices of decoder layers that carry adapters (None: all)")
    top_layers: int | None = Field(
        None, gt=0, description="Adapters on the top N decoder layers only; the frozen layers below are computed once "
        "for policy and reference (train.share_frozen_layers). Exclusive with layers")
    use_rslora: bool = Field(False, description="Scale by alpha/sqrt(rank) instead of alpha/rank")
    init_from: str | None = Field(None, description="Start from an existing PEFT adapter folder")


class MoLoRAConfig(Section):
    """A mixture of LoRA experts instead of one LoRA adapter (docs/molora.md): N experts per adapted linear layer,
    mixed by a router; `lora.*` keys then do not apply."""

    num_experts: int = Field(4, ge=1, description="N: LoRA experts per adapted module")
    rank: int = Field(8, gt=0, description="r of every expert")
    alpha: float = Field(16.0, gt=0, description="Each expert is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input (not the router's)")
    target_modules: str | list[str] = Field(
        "all-linear", description="'all-linear' (every linear layer inside the decoder layers) or module names")
    router: Literal["sequence", "token"] = Field(
        "sequence", description="sequence: once per sequence from the prompt; token: every token at every module")
    top_k: int = Field(2, ge=1, description="Experts kept per routing decision (1..num_experts)")
    renormalize: bool = Field(
        True, description="Kept gates are rescaled to sum to 1 (off: the raw softmax probabilities, as Switch)")
    hydra: bool = Field(False, description="HydraLoRA: one shared A matrix, one B matrix per expert")
    balance_coef: float = Field(0.01, ge=0, description="Weight of the load-balancing loss")
    z_coef: float = Field(0.001, ge=0, description="Weight of the router z-loss")
    router_init_std: float = Field(0.02, ge=0, description="Router weights ~ N(0, std) at start (0: uniform)")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            return value if value == "all-linear" else [value]
        if not value:
            raise ValueError("target_modules: give 'all-linear' or at least one module name")
        return value

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoLoRAConfig":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class DataConfig(Section):
    task: str | None = Field(None, description="Built-in reasoning-gym task name (e.g. chain_sum)")
    task_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the task generator")
    path: str | None = Field(None, description="Local json/jsonl/parquet/csv file of prompts")
    eval_path: str | None = Field(None, description="Local held-out file (same columns as path)")
    prompt_column: str = "prompt"
    answer_column: str | None = Field("answer", description="Passed to reward functions as `answer` if present")
    system_prompt: str | None = None
    use_chat_template: bool = Field(True, description="Wrap prompts with the tokenizer's chat template if it has one")
    train_size: int = Field(1000, gt=0, description="Number of generated training problems (tasks only)")
    eval_size: int = Field(100, ge=0, description="Held-out problems (tasks: generated with eval_seed)")
    seed: int = 0
    shuffle: bool = Field(True, description="Shuffle the training prompts each epoch (off: file/generation order)")
    eval_seed: int = Field(1_000_003, description="Seed of the held-out task split; must differ from seed")


class RewardSpec(Section):
    fn: str = Field(description="Built-in name (gym, format, math, code, closeness), reward_model (a reward adapter of `rlora "
                    "rm` on the policy's base: args.path, docs/reward_models.md), a file FILE.py:function (relative "
                    "to the config file; my_reward.function also finds my_reward.py there) or an importable "
                    "module.function")
    weight: float = 1.0
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the function "
                                 "(reward_model: path, and optionally batch_size, use_chat_template, system_prompt)")
    timeout_s: float | None = Field(
        300.0, gt=0, description="A call (one batch) that runs longer stops the run with an error (None: no limit)")


class ThinkConfig(Section):
    """Phase-aware sampling: other settings while a completion is inside a thinking span."""

    start: str = Field("<think>", min_length=1, description="Text that opens the thinking span")
    end: str = Field("</think>", min_length=1, description="Text that closes it (its last token is still drawn inside)")
    temperature: float = Field(1.0, gt=0, description="Temperature inside the span (rollout.temperature after it)")
    top_p: float = Field(1.0, gt=0, le=1, description="top_p inside the span (rollout.top_p after it)")
    starts_inside: bool = Field(
        False, description="Completions begin inside the span (the prompt, e.g. the chat template, already opened it)")


class RolloutConfig(Section):
    num_generations: int = Field(8, ge=1, description="G: completions sampled per prompt (1 only with algo.name=ppo)")
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (at the first step, with a schedule)")
    temperature_end: float | None = Field(None, gt=0, description="Temperature at the last step (None: constant)")
    temperature_schedule: Literal["constant", "linear", "cosine", "exponential"] = Field(
        "constant", description="How the temperature moves from temperature to temperature_end over train.steps")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    min_new_tokens: int = Field(0, ge=0, description="EOS is suppressed until this many tokens (benchmarks: = max)")
    min_p: float = Field(0.0, ge=0, lt=1, description="Drop tokens below min_p x the top token's probability (0: off)")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion (kept in it)")
    engine: Literal["builtin", "hf"] = Field(
        "builtin", description="builtin: rlora's sampler (Llama, Qwen2/Qwen3, Mistral, Gemma 3 text, Phi-3/Phi-4, "
        "OLMo 2/3, SmolLM3, GLM-4, ERNIE 4.5, Seed-OSS, Mixtral, Qwen2/3-MoE, OLMoE; others fall back to hf); "
        "hf: transformers generate, each token drawn as the builtin engine draws it")
    merge_adapter: bool | Literal["auto"] = Field(
        "auto", description="builtin engine: sample with LoRA merged into fresh fused weight copies (needs memory for a "
        "copy of the linear weights during sampling; set false for models whose weights would not fit twice). auto: "
        "true, but false where the base's layers stream through the sampler (train.fsdp_gather=layer: a merged "
        "adapter is merged again into every layer in every decode step, 1.45x slower)")
    weight_packs: bool = Field(
        True, description="builtin engine on an x86 CPU, with merge_adapter (float32, or bfloat16 where the CPU "
        "computes it natively): the frozen base's linear maps run from oneDNN-packed copies made once and kept for the "
        "run (through training too; in the sampler's dtype), each LoRA unmerged beside them: float32 sampling 1.5-1.7x "
        "faster than from merged copies (MKL re-packs a weight on every product; bf16: within noise), the same products "
        "through another kernel. false: merged copies each call, freed in between (less memory while training; what a "
        "train.fsdp run samples with: its base is gathered anew); may change on resume")
    cuda_graphs: bool = Field(
        True, description="builtin engine on a GPU: decode with fixed shapes, each step replayed as a CUDA graph (one "
        "launch instead of ~30 per layer); false: the eager step that drops finished rows. No effect on CPUs")
    sampler_dtype: Literal["auto", "model", "bfloat16", "float16", "float32", "float16_weights"] = Field(
        "auto", description="builtin engine compute dtype. auto (when algo.sampler_is_cap is set and the model is "
        "float32): bfloat16 where the device computes it natively (GPUs from Ampere; CPUs with AVX512-BF16/AMX), "
        "float16_weights on other x86 CPUs with AVX2, else model; a resumed run keeps its checkpoint's; the choice "
        "is printed and saved in config.yaml. bfloat16 on a float32 model: ~2.2-2.6x the speed of float32 from merged "
        "copies on such CPUs, 1.1-1.3x that of float32 from oneDNN packs (rollout.weight_packs); ~2x slower on "
        "AVX2-only CPUs. float16_weights (float32 models on x86 CPUs): float32 compute from float16 copies of the "
        "base weights (fbgemm), the LoRA unmerged, 1.5-2.3x faster than merged float32 on AVX2-only CPUs (1.2x float32 "
        "from packs on an AVX512 one). Both sample slightly off-policy (pair with algo.sampler_is_cap)")
    think: ThinkConfig | None = Field(
        None, description="sample the thinking span (start..end) with its own temperature/top_p; the "
        "training log-probs use each token's own temperature (null: one setting for the whole completion)")

    def think_phase(self) -> ThinkPhase | None:
        """The think section as the sampler's ThinkPhase (None when off)."""
        from rlora.types import ThinkPhase  # here, so that loading a config does not import torch

        return None if self.think is None else ThinkPhase(**self.think.model_dump())


class EnvConfig(Section):
    """Multi-turn episodes instead of single completions (docs/environments.md)."""

    fn: str = Field(description="Built-in environment (calculator, tools, textarena) or a factory that returns a "
                    "fresh Environment per episode: FILE.py:name (relative to the config file; module.name also finds "
                    "module.py there) or an importable module.name")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the factory")
    max_turns: int = Field(4, ge=1, description="Policy turns per episode (an episode still running then is truncated)")
    max_total_tokens: int = Field(1024, gt=0, description="Tokens after the first prompt, the policy's and the "
                                  "environment's (rollout.max_new_tokens caps each turn)")
    step_timeout_s: float | None = Field(30.0, gt=0, description="Limit of one reset()/step() call (null: none); "
                                         "an environment that exceeds it fails its episode")


class SamplingSetting(Section):
    temperature: float = Field(gt=0)
    top_p: float = Field(1.0, gt=0, le=1)


class AdaptiveConfig(Section):
    """Adaptive GRPO: resample groups that fail a condition with escalating sampling settings."""

    enabled: bool = Field(False, description="Resample failing groups (on by default for algo.name=adaptive_grpo)")
    condition: Literal["no_success", "zero_variance", "no_success_or_zero_variance"] = Field(
        "no_success", description="When a group is resampled: no sample reaches success_reward, all rewards equal, or either")
    success_reward: float = Field(1.0, description="A sample succeeds when its total reward is at least this")
    schedule: list[SamplingSetting] = Field(
        default_factory=lambda: [SamplingSetting(temperature=1.0), SamplingSetting(temperature=1.2)], min_length=1,
        description="Settings of retry 1, 2, ... (the last one repeats for further retries)")
    max_retries: int = Field(2, ge=1, le=16, description="Resamples of one group in one step")
    step_budget: int | None = Field(None, ge=1, description="Most group resamples in one step, each policy's and each "
                                    "rank's own (None: no cap)")
    adv_stats: Literal["kept", "all"] = Field(
        "kept", description="Advantage baseline/std from the kept attempt only, or from all attempts of the prompt")


class ReplayConfig(Section):
    """Experience replay of informative groups, corrected by truncated importance weights."""

    enabled: bool = False
    capacity: int = Field(64, gt=0, description="Groups kept (oldest leave first)")
    ratio: float = Field(0.25, gt=0, description="Replayed groups per fresh group in a step")
    min_adv_abs: float = Field(1e-6, ge=0, description="Keep groups whose largest |advantage| exceeds this")
    max_uses: int = Field(2, ge=1, description="Times a stored group can be replayed")
    is_cap: float = Field(2.0, ge=1, description="Cap of the importance weight pi_old / pi_behaviour of replayed tokens")


class AlgoConfig(Section):
    name: str = Field("grpo", description="Algorithm (see docs/algorithms.md): grpo, dr_grpo, dapo, gspo, cispo, "
                      "rloo, reinforce_pp, reinforce_pp_baseline, adaptive_grpo, ppo; each presets the keys its paper uses")
    beta: float = Field(0.0, ge=0, description="Weight of the KL to the reference (adapter off): k3 in the loss, or "
                        "k1 in the token reward for reinforce_pp")
    loss_agg: Literal["token_mean", "seq_mean", "constant"] = "token_mean"
    constant_norm: int | None = Field(None, gt=0, description="Tokens per sequence for loss_agg=constant (default max_new_tokens)")
    adv_scale: Literal["group", "batch", "none"] = Field("group", description="Divide advantages by this std")
    adv_eps: float = Field(1e-4, gt=0)
    clip_low: float = Field(0.2, ge=0, le=1, description="Ratio clipped below at 1 - clip_low (1: no lower clip)")
    clip_high: float = Field(0.2, ge=0, description="Ratio clipped above at 1 + clip_high")
    num_iterations: int = Field(1, ge=1, description="Policy updates per rollout (mu)")
    sampler_is_cap: float | None = Field(
        None, ge=1, description="Weight each token by min(pi_old / pi_sampler, cap) (truncated importance sampling)")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus: subtract coef x entropy per token from the loss")
    mask_truncated: bool = Field(False, description="Completions cut at max_new_tokens leave the loss (overlong filtering)")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal and sample more prompts until the step is full")
    max_extra_rounds: int = Field(3, ge=0, description="Extra sampling rounds per step for dynamic_sampling")
    overlong_buffer: int = Field(0, ge=0, description="DAPO overlong shaping: penalise the last this many tokens before max_new_tokens")
    overlong_penalty: float = Field(1.0, ge=0, description="Penalty at max_new_tokens (linear from 0 over the buffer)")
    adaptive: AdaptiveConfig = Field(default_factory=AdaptiveConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)

    @field_validator("name")
    @classmethod
    def _known_algorithm(cls, name: str) -> str:
        if name not in ALGORITHM_NAMES:
            close = difflib.get_close_matches(name, ALGORITHM_NAMES, n=1)
            raise ValueError(f"unknown algo.name '{name}' (" + (f"did you mean '{close[0]}'?" if close else
                             f"available: {', '.join(ALGORITHM_NAMES)}") + ")")
        return name


class PPOConfig(Section):
    """PPO with a critic on the policy's base (algo.name=ppo, docs/algorithms.md#ppo): a value adapter beside the
    policy's plus an fp32 value head, GAE advantages, clipped value loss."""

    gamma: float = Field(1.0, ge=0, le=1, description="Discount per completion token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (1: Monte-Carlo returns minus V, 0: one-step TD)")
    value_clip: float | None = Field(
        0.2, gt=0, description="Clip new values to old +- this in the value loss (null: plain squared error)")
    whiten_advantages: bool = Field(True, description="Advantages -> (A - mean) / (std + algo.adv_eps) over the "
                                    "batch's real completion tokens")
    kl_mode: Literal["reward", "loss"] = Field(
        "reward", description="reward: -algo.beta x (old - ref log-prob) on every token's reward (k1, as InstructGPT); "
        "loss: algo.beta x k3 KL in the policy loss")
    value_rank: int | None = Field(None, gt=0, description="Rank of the value adapter (null: lora.rank; beside a "
                                   "MoLoRA policy molora.rank)")
    value_alpha: float | None = Field(None, gt=0, description="Alpha of the value adapter (null: lora.alpha; beside "
                                      "a MoLoRA policy molora.alpha)")
    value_lr: float | None = Field(None, gt=0, description="Learning rate of the value adapter and head (null: "
                                   "train.lr; with policies: each policy's lr); same warmup/schedule")
    value_head_init_std: float = Field(0.0, ge=0, description="Normal std of the value head's initial weight (0: zeros)")


class OptimizerConfig(Section):
    """The keys `rlora train`, `rlora sft` and `rlora rm` share: optimizer, schedule, seed, output folder."""

    steps: int = Field(20, gt=0)
    lr: float = Field(1e-4, gt=0)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    seed: int = 0
    output_dir: str | None = Field(None, description="Default: runs/COMMAND-YYYYmmdd-HHMMSS (train, sft or rm)")
    overwrite: bool = Field(False, description="Allow writing into an existing non-empty output_dir")
    threads: int | None = Field(None, gt=0, description="torch CPU threads (default: torch's choice)")


class ResumableConfig(OptimizerConfig):
    """The checkpoint keys `rlora train`, `rlora sft` and `rlora rm` share (docs/checkpoints.md)."""

    checkpoint_every: int = Field(
        0, ge=0, description="Write a resumable checkpoint (adapter, optimizer, scheduler, RNG, step) every N steps "
        "and at the end (0: never)")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept in output_dir/checkpoints (oldest removed)")
    resume: str | None = Field(
        None, description="'auto': continue from the newest valid checkpoint in output_dir (or start fresh if none); "
        "or a checkpoints/step-N folder")


class TrainConfig(ResumableConfig):
    prompts_per_step: int = Field(4, gt=0)
    micro_batch_size: int = Field(8, gt=0, description="Completions per forward/backward pass")
    save_every: int = Field(0, ge=0, description="Save adapter-stepN every N steps (0: only at the end)")
    sample_every: int = Field(5, ge=0, description="Write sample completions every N steps (0: never)")
    max_reward_failure_frac: float = Field(0.25, ge=0, le=1, description="Stop if more samples' rewards fail in a step")
    max_time_s: float | None = Field(None, gt=0, description="Stop after the step that passes this much training time")
    logprob_chunk_tokens: int = Field(
        256, ge=0, description="Completion positions per output-layer chunk in log-prob passes (0: full logits)")
    gradient_checkpointing: bool = Field(False, description="Recompute decoder activations in backward (less memory)")
    share_frozen_layers: bool = Field(
        True, description="Decoder layers below the lowest adapter layer run once per step for the reference, old "
        "and policy log-prob passes (the built-in sampler's model families, chunked log-probs)")
    share_prompts: bool = Field(
        True, description="Each log-prob pass runs a prompt once for the rows that share it (its G samples), "
        "where the numbers stay those of separate rows (models/shared_prompts.py)")
    pack_groups: bool = Field(
        True, description="Where prompts are shared, each prompt and its rows' completions run as one sequence "
        "(or a few, for long completions) without the completions' padding, when that is less arithmetic "
        "(models/packed_groups.py)")
    release_memory: bool = Field(
        False, description="Return freed blocks over 1 MiB to the OS at once (glibc): lower peak RSS, more system time")
    autocast: Literal["auto", "bfloat16", "off"] = Field(
        "auto", description="The trainer's log-prob passes (reference, old, policy) and backward under torch.autocast: "
        "'bfloat16' runs the adapters' matmuls in bf16 on the base's bf16 activations instead of float32 copies of "
        "them (less activation memory; the adapters' weights and gradients stay float32); 'auto': bfloat16 for a "
        "bfloat16 model on a device that computes bf16 natively, else off")
    @field_validator("autocast", mode="before")
    @classmethod
    def _off_is_a_word(cls, value):
        return "off" if value is False else value  # YAML reads a bare `off` as false

    fsdp: bool = Field(
        False, description="Under torchrun (2+ ranks): shard the frozen base's decoder layers across the ranks with "
        "FSDP2 (docs/fsdp.md)")
    fsdp_gather: Literal["model", "layer"] = Field(
        "model", description="train.fsdp sampling: 'model' gathers the whole base for each sampling call (fast; the "
        "base must fit one device); 'layer' gathers one decoder layer at a time in every decode step (bases larger "
        "than one device; an all-gather per layer per token)")


class EvalConfig(Section):
    before: bool = Field(True, description="Evaluate the held-out set before training")
    after: bool = Field(True, description="Evaluate the held-out set after training")
    max_new_tokens: int | None = Field(None, gt=0, description="Default: rollout.max_new_tokens")
    batch_size: int = Field(32, gt=0, description="Prompts per sampler call")
    num_samples: int = Field(1, gt=0, description="Completions per prompt (more than 1 needs temperature > 0)")
    temperature: float = Field(0.0, ge=0, description="0: greedy decoding")
    top_p: float = Field(1.0, gt=0, le=1)
    pass_k: list[int] = Field(default_factory=list, description="k values of the unbiased pass@k (each <= num_samples)")
    seed: int = Field(0, description="Seed of the evaluation's sampling")

    @model_validator(mode="after")
    def _check_sampling(self) -> "EvalConfig":
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"eval.num_samples={self.num_samples} with greedy decoding (eval.temperature=0) repeats "
                             "one completion: set eval.temperature > 0")
        if any(k < 1 or k > self.num_samples for k in self.pass_k):
            raise ValueError(f"eval.pass_k={self.pass_k}: each k must be between 1 and eval.num_samples={self.num_samples}")
        return self


class LogConfig(Section):
    """Where a run's numbers go besides metrics.jsonl and the console (docs/logging.md)."""

    tensorboard: bool = Field(False, description="Write TensorBoard event files to OUTPUT/tensorboard (extra: track)")
    wandb: bool = Field(False, description="Log to Weights & Biases (extra: track); files in OUTPUT/wandb")
    wandb_project: str = Field("rlora", min_length=1, description="W&B project name")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: no network, upload later with `wandb sync OUTPUT/wandb/offline-run-*`")
    completions_format: Literal["jsonl", "parquet"] = Field(
        "jsonl", description="Completions of train.sample_every steps: samples.jsonl, or one "
        "OUTPUT/completions/step-N.parquet per step")
    plot: bool = Field(True, description="Write PNG figures of the metrics to OUTPUT/plots at the end of a run")


class PolicySpec(Section):
    """One of several policy adapters trained together on one base (docs/policies.md)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="Names the policy's folder OUTPUT/policies/NAME and "
                      "its metrics (letters, digits, '_', '-')")
    lr: float | None = Field(None, gt=0, description="Its learning rate (null: train.lr); with algo.name=ppo its "
                             "critic's too, unless ppo.value_lr is set")
    seed: int | None = Field(None, description="Its adapter's initialisation and sampling seed (null: train.seed)")
    beta: float | None = Field(None, ge=0, description="Its KL coefficient in the loss (null: algo.beta)")


class RLConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rewards: list[RewardSpec] = Field(default_factory=list)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    molora: MoLoRAConfig | None = Field(
        None, description="The policy is a mixture of LoRA experts (docs/molora.md) instead of the lora adapter; "
        "every lora.* key must then keep its default (null: plain LoRA)")
    ppo: PPOConfig | None = Field(
        None, description="PPO's critic and GAE settings: algo.name=ppo only (it fills in the defaults where absent)")
    env: EnvConfig | None = Field(
        None, description="Train on episodes of several turns with an environment or tools (docs/environments.md); "
        "null: one completion per prompt")
    policies: list[PolicySpec] | None = Field(
        None, description="Train several LoRA policies (same lora.* shape) on one base in one run, each with its own "
        "optimizer, metrics and folder, all served by one batched pass (docs/policies.md); null: one policy")

    def constant_norm(self) -> int:
        """Tokens per sequence used by loss_agg=constant (Dr.GRPO): default the completion length limit (an
        episode's: the policy's tokens of at most max_turns turns within env.max_total_tokens)."""
        if self.algo.constant_norm:
            return self.algo.constant_norm
        if self.env is not None:
            return min(self.env.max_turns * self.rollout.max_new_tokens, self.env.max_total_tokens)
        return self.rollout.max_new_tokens
