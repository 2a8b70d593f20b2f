"""Every refused combination of settings, as one table, checked before any model loads.

A row names the commands it applies to, a predicate over the validated config (after the algorithm's
presets) and the one-line message that says what to change. Rows marked `launch` also read the number of
data-parallel ranks, which is known once torchrun has started the process: `check_config` runs the other
rows when a config loads, `check_launch` runs these from the recipe's input checks, so each row is checked
once on the way to training, and `rlora eval` of a sharded run's folder is not refused for lacking torchrun.
Each row carries an example (overrides of the command's base config) that triggers it; a test walks the table
and docs/configuration.md lists it. What a row needs to know about the algorithm it reads from the algorithm's
traits (rlora/presets.py, the data the registry builds its flags from), never from its name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlora.config.schema import LoraConfig, RLConfig
from rlora.config.supervised import RMConfig, SFTConfig
from rlora.errors import UserError
from rlora.presets import TRAITS, Traits

COMMANDS = {RLConfig: "train", SFTConfig: "sft", RMConfig: "rm"}
# what the rows' examples override (load_config without a file): the demo for `rlora train`, the defaults and a data
# file for sft and rm (the file is not read while the config loads)
EXAMPLE_BASES: dict[str, tuple[type, tuple[str, ...]]] = {
    "train": (RLConfig, ()), "sft": (SFTConfig, ("data.path=rows.jsonl",)), "rm": (RMConfig, ("data.path=rows.jsonl",))}


class RefusedCombination(UserError):
    """A UserError that names the table row that refused the config."""

    def __init__(self, row: str, message: str):
        super().__init__(message)
        self.row = row


@dataclass(frozen=True)
class Refusal:
    name: str
    commands: tuple[str, ...]
    refused: Callable[..., bool]  # (cfg) -> bool, or (cfg, ranks) -> bool for a launch row
    message: str | Callable[..., str]  # the same arguments -> the message
    example: tuple[str, ...]  # overrides of the command's base config that trigger this row
    launch: bool = False  # reads the number of ranks: checked by check_launch, with `example_ranks` in the test
    example_ranks: int = 2


def _molora_lora_key(cfg) -> str | None:
    """The first lora.* key set to something but its default in a config with a molora section."""
    defaults = LoraConfig()
    return next((key for key in LoraConfig.model_fields if getattr(cfg.lora, key) != getattr(defaults, key)), None)


# lora.* keys with a molora.* counterpart; the others (layers, top_layers, use_rslora, init_from) have none
_MOLORA_COUNTERPARTS = ("rank", "alpha", "dropout", "target_modules")


def _molora_lora_message(cfg) -> str:
    key = _molora_lora_key(cfg)
    if key in _MOLORA_COUNTERPARTS:
        return f"lora.{key} does not apply with molora (the experts use molora.{key}): remove lora.{key}"
    if key == "init_from":
        return ("lora.init_from loads a PEFT adapter; molora starts its experts fresh: remove lora.init_from "
                "(continuing from a MoLoRA folder is not supported yet)")
    return f"lora.{key} is not supported with molora: remove lora.{key}"


# lora.* keys that lora.init_from does not apply (PEFT loads the adapter with its own), by adapter_config.json's names
_ADAPTER_KEYS = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "target_modules",
                 "use_rslora": "use_rslora"}


def _adapter_settings(folder: Path) -> dict[str, Any] | None:
    """The lora.* values recorded in an adapter folder's adapter_config.json (None where it cannot be read)."""
    try:
        meta = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    settings = {key: meta.get(name) for key, name in _ADAPTER_KEYS.items()}
    if isinstance(settings["target_modules"], list):  # PEFT saves all-linear as full module paths: compare the names
        settings["target_modules"] = {str(name).rpartition(".")[2] for name in settings["target_modules"]}
    return settings


def check_init_from_keys(lora: LoraConfig) -> None:
    """lora.init_from loads the adapter with its own rank, alpha, dropout, targets and rsLoRA flag: refuse a lora.* key
    it would silently ignore, set to something other than its default and to something other than the adapter's own
    value (a config that repeats the adapter's rank is fine). Not a row of the table: it reads the adapter folder,
    so the recipes call it from their input checks once the folder is known to be an adapter (check_adapter_folder);
    `rlora eval` of a run whose starting adapter has since moved is not refused."""
    adapter = _adapter_settings(Path(lora.init_from)) if lora.init_from else None
    if adapter is None:
        return
    defaults = LoraConfig()
    for key in _ADAPTER_KEYS:
        value = getattr(lora, key)
        if value == getattr(defaults, key):
            continue
        if key == "target_modules" and isinstance(value, list):
            value = set(value)
        if value != adapter[key]:
            theirs = sorted(adapter[key]) if isinstance(adapter[key], set) else adapter[key]
            raise UserError(f"lora.init_from loads the adapter with its own rank, alpha and target modules ("
                            f"{lora.init_from} has {key} {theirs}): remove lora.{key}")


def _adapter_dropout(cfg) -> str | None:
    """'lora.dropout=R' or 'molora.dropout=R' where the policy's adapter has dropout, else None."""
    key, rate = ("molora.dropout", cfg.molora.dropout) if cfg.molora is not None else ("lora.dropout", cfg.lora.dropout)
    return f"{key}={rate:g}" if rate > 0 else None


def init_from_dropout(lora: LoraConfig) -> float:
    """The lora_dropout recorded in lora.init_from's adapter_config.json (0 without one, or where it cannot be read)."""
    adapter = _adapter_settings(Path(lora.init_from)) if lora.init_from else None
    rate = (adapter or {}).get("dropout")
    return float(rate) if isinstance(rate, (int, float)) else 0.0


def _traits(cfg) -> Traits:
    return TRAITS[cfg.algo.name]


def _ppo_group_option(cfg) -> str | None:
    algo = cfg.algo
    options = (("algo.dynamic_sampling", algo.dynamic_sampling), ("algo.adaptive", algo.adaptive.enabled),
               ("algo.replay", algo.replay.enabled))
    return next((key for key, wanted in options if wanted), None)


def _duplicate_policy(cfg) -> str | None:
    names = [p.name for p in cfg.policies or []]
    return next((n for n in names if names.count(n) > 1), None)


def _policies(refused: Callable[[Any], bool], what: str | Callable[[Any], str], fix: str, example: tuple[str, ...],
              name: str) -> Refusal:
    """A feature that a run of several policies does not support yet."""
    two = ("policies=[{name: a}, {name: b}]",)

    def message(cfg) -> str:
        return (f"policies: several policies in one run do not support {what(cfg) if callable(what) else what} yet: "
                f"{fix}, or train the policies in separate runs")
    return Refusal(name, ("train",), lambda cfg: cfg.policies is not None and refused(cfg), message, two + example)


def _fsdp(name: str, refused: Callable[[Any], bool], message: str, example: tuple[str, ...]) -> Refusal:
    """What a sharded base does not support: a launch row (checked when `rlora train` starts under torchrun), so
    that `rlora eval RUN` of a sharded run, which never shards, is not refused for an override it accepts."""
    return Refusal(name, ("train",), lambda cfg, _ranks: cfg.train.fsdp and refused(cfg), message,
                   ("train.fsdp=true", *example), launch=True)


MOLORA = ("molora={num_experts: 2}",)
ENV = ("env={fn: calculator}",)

REFUSALS: tuple[Refusal, ...] = (
    # ---- sections that exclude each other
    Refusal("lora-layers-and-top-layers", ("train", "sft", "rm"),
            lambda cfg: cfg.lora.layers is not None and cfg.lora.top_layers is not None,
            "set lora.layers (indices) or lora.top_layers (a count from the top), not both",
            ("lora.layers=[0]", "lora.top_layers=1")),
    Refusal("lora-init-from-with-layers", ("train", "sft", "rm"),
            lambda cfg: bool(cfg.lora.init_from) and (cfg.lora.layers is not None or cfg.lora.top_layers is not None),
            "lora.init_from keeps the layers of the adapter it loads: remove lora.layers / lora.top_layers",
            ("lora.init_from=adapter", "lora.top_layers=1")),
    Refusal("molora-full-finetune", ("sft",), lambda cfg: cfg.molora is not None and cfg.train.full_finetune,
            "molora trains adapters; train.full_finetune trains the model itself: use one of the two",
            MOLORA + ("train.full_finetune=true",)),
    Refusal("molora-lora-keys", ("train", "sft"), lambda cfg: cfg.molora is not None and _molora_lora_key(cfg) is not None,
            _molora_lora_message, MOLORA + ("lora.rank=4",)),
    # the sampler and the old and reference passes run without dropout (as without the base's, which rlora train turns
    # off); an update that drops adapter inputs would make every importance weight and clipped ratio measure that noise
    Refusal("adapter-dropout-in-rl", ("train",), lambda cfg: _adapter_dropout(cfg) is not None,
            lambda cfg: f"{_adapter_dropout(cfg)} in rlora train: the sampler, the old and the reference log-probs "
                        "run without dropout, so the importance weights and clipped ratios would measure the update's "
                        "dropout noise (lora.dropout=0.1 moved them by 0.115 nats a token): set it to 0 (dropout is "
                        "for rlora sft and rm)", ("lora.dropout=0.1",)),
    Refusal("full-finetune-with-adapter-options", ("sft",),
            lambda cfg: cfg.train.full_finetune and bool(cfg.lora.init_from or cfg.model.quantization != "none"),
            "train.full_finetune trains the model itself: unset lora.init_from and model.quantization",
            ("train.full_finetune=true", "model.quantization=8bit")),
    # ---- data and batches
    Refusal("data-task-or-path", ("train",), lambda cfg: (cfg.data.task is None) == (cfg.data.path is None),
            # both set is usually data.path given on top of a config with a task (the demo's): say how to unset it
            lambda cfg: "set exactly one of data.task (a reasoning-gym task) or data.path (a local file)" + (
                f", not both (data.task=null unsets the task {cfg.data.task}, e.g. the demo's)"
                if cfg.data.task is not None else ""), ("data.path=rows.jsonl",)),
    Refusal("data-seed-is-eval-seed", ("train",),
            lambda cfg: cfg.data.task is not None and cfg.data.seed == cfg.data.eval_seed,
            "data.seed equals data.eval_seed: the held-out split would repeat the training problems",
            ("data.seed=7", "data.eval_seed=7")),
    # before the micro-batch rows: with one generation the batch arithmetic is not what needs changing
    Refusal("one-generation-without-critic", ("train",),
            lambda cfg: not _traits(cfg).critic and cfg.rollout.num_generations < 2,
            lambda cfg: f"rollout.num_generations=1 gives {cfg.algo.name} no group to compare (every advantage 0): use "
                        "at least 2, or algo.name=ppo (its critic is the baseline)", ("rollout.num_generations=1",)),
    Refusal("micro-batch-divides-completions", ("train",),
            lambda cfg: cfg.train.prompts_per_step * cfg.rollout.num_generations % cfg.train.micro_batch_size != 0,
            lambda cfg: f"train.prompts_per_step x rollout.num_generations = "
                        f"{cfg.train.prompts_per_step * cfg.rollout.num_generations} is not divisible by "
                        f"train.micro_batch_size = {cfg.train.micro_batch_size}", ("train.micro_batch_size=5",)),
    Refusal("micro-batch-divides-batch", ("sft", "rm"), lambda cfg: cfg.train.batch_size % cfg.train.micro_batch_size != 0,
            lambda cfg: f"train.batch_size={cfg.train.batch_size} is not divisible by "
                        f"train.micro_batch_size={cfg.train.micro_batch_size}",
            ("train.batch_size=6", "train.micro_batch_size=4")),
    Refusal("steps-and-epochs", ("sft",), lambda cfg: cfg.train.epochs is not None and cfg.train.steps is not None,
            # one of the two is often a preset of the config file: null unsets it from the command line
            "set train.steps or train.epochs, not both (train.epochs=null or train.steps=null unsets one)",
            ("train.steps=3", "train.epochs=1")),
    Refusal("no-rewards", ("train",), lambda cfg: not cfg.rewards and cfg.env is None,
            # gym scores a reasoning-gym task; a data file's rows are scored against their answer column
            lambda cfg: "no reward functions: add e.g. `rewards: [{fn: %s}]` to the config"
                        % ("gym" if cfg.data.task is not None else "math"), ("rewards=[]",)),
    # ---- environments (multi-turn episodes)
    Refusal("env-system-prompt", ("train",), lambda cfg: cfg.env is not None and cfg.data.system_prompt is not None,
            "with env the environment writes the first messages: set env.args.system_prompt (calculator, tools, "
            "textarena take one) instead of data.system_prompt", ENV + ("data.system_prompt=Be brief.",)),
    Refusal("env-without-chat-template", ("train",), lambda cfg: cfg.env is not None and not cfg.data.use_chat_template,
            "episodes are rendered with the chat template: set data.use_chat_template=true with env",
            ENV + ("data.use_chat_template=false",)),
    Refusal("env-overlong", ("train",), lambda cfg: cfg.env is not None and cfg.algo.overlong_buffer > 0,
            "algo.overlong_buffer measures one completion against rollout.max_new_tokens; an episode has several "
            "turns: set algo.overlong_buffer=0 (env.max_total_tokens bounds an episode)", ENV + ("algo.overlong_buffer=8",)),
    # ---- sampling
    Refusal("min-new-tokens-over-max", ("train",), lambda cfg: cfg.rollout.min_new_tokens > cfg.rollout.max_new_tokens,
            "rollout.min_new_tokens must not exceed rollout.max_new_tokens", ("rollout.min_new_tokens=1000",)),
    Refusal("empty-stop-string", ("train",), lambda cfg: any(not s for s in cfg.rollout.stop),
            "rollout.stop holds an empty string: every stop string needs at least one character", ("rollout.stop=['']",)),
    Refusal("temperature-schedule-without-end", ("train",),
            lambda cfg: cfg.rollout.temperature_schedule != "constant" and cfg.rollout.temperature_end is None,
            lambda cfg: f"rollout.temperature_schedule={cfg.rollout.temperature_schedule} needs rollout.temperature_end",
            ("rollout.temperature_schedule=linear",)),
    Refusal("temperature-end-without-schedule", ("train",),
            lambda cfg: cfg.rollout.temperature_schedule == "constant" and cfg.rollout.temperature_end is not None,
            "rollout.temperature_end is set but rollout.temperature_schedule is constant: choose linear, cosine or "
            "exponential (or unset temperature_end)", ("rollout.temperature_end=0.5",)),
    Refusal("hf-engine-builtin-options", ("train",),
            lambda cfg: cfg.rollout.engine == "hf" and (cfg.rollout.sampler_dtype not in ("auto", "model")
                                                        or cfg.rollout.merge_adapter is False),
            "rollout.sampler_dtype and rollout.merge_adapter apply to rollout.engine=builtin only: set "
            "rollout.sampler_dtype=model (and merge_adapter=true) with rollout.engine=hf",
            ("rollout.engine=hf", "rollout.sampler_dtype=bfloat16")),
    Refusal("float16-weights-needs-a-float32-cpu-model", ("train",),
            lambda cfg: cfg.rollout.sampler_dtype == "float16_weights" and (
                cfg.model.dtype != "float32" or cfg.model.device.startswith("cuda") or cfg.rollout.merge_adapter is False
                or cfg.train.fsdp),
            "rollout.sampler_dtype=float16_weights samples a float32 model on a CPU from float16 copies of a base that "
            "stays put, with the LoRA beside them: use it with model.dtype=float32, model.device=cpu, "
            "rollout.merge_adapter=true and train.fsdp=false, or set rollout.sampler_dtype=auto",
            ("rollout.sampler_dtype=float16_weights", "rollout.merge_adapter=false")),
    Refusal("autocast-bf16-needs-a-bf16-or-float32-model", ("train",),
            lambda cfg: cfg.train.autocast == "bfloat16" and (cfg.model.dtype == "float16" or cfg.train.fsdp),
            "train.autocast=bfloat16 runs a bfloat16 or float32 model's passes in bf16, without train.fsdp (its "
            "layers manage their own dtypes): set train.autocast=off, or model.dtype=bfloat16 and train.fsdp=false",
            ("train.autocast=bfloat16", "model.dtype=float16")),
    # ---- algorithms
    Refusal("overlong-buffer-over-length", ("train",), lambda cfg: cfg.algo.overlong_buffer > cfg.rollout.max_new_tokens,
            lambda cfg: f"algo.overlong_buffer={cfg.algo.overlong_buffer} exceeds rollout.max_new_tokens="
                        f"{cfg.rollout.max_new_tokens}: the buffer is the last part of the length limit",
            ("algo.overlong_buffer=1000",)),
    Refusal("gspo-sequence-loss", ("train",),
            lambda cfg: _traits(cfg).sequence_ratio and cfg.algo.loss_agg != "seq_mean",
            "gspo clips one ratio per sequence: use algo.loss_agg=seq_mean", ("algo.name=gspo", "algo.loss_agg=token_mean")),
    Refusal("adaptive-all-stats-batch-whitened", ("train",),
            lambda cfg: cfg.algo.adaptive.adv_stats == "all" and _traits(cfg).batch_statistics,
            "algo.adaptive.adv_stats=all needs group advantages; reinforce_pp whitens over the batch: use "
            "algo.adaptive.adv_stats=kept", ("algo.name=reinforce_pp", "algo.adaptive.adv_stats=all")),
    Refusal("ppo-section-without-ppo", ("train",), lambda cfg: not _traits(cfg).critic and cfg.ppo is not None,
            lambda cfg: f"the ppo section applies to algo.name=ppo, not {cfg.algo.name}: remove it or set algo.name=ppo",
            ("ppo={}",)),
    Refusal("ppo-group-options", ("train",), lambda cfg: _traits(cfg).critic and _ppo_group_option(cfg) is not None,
            lambda cfg: f"{_ppo_group_option(cfg)} works on groups of samples and group advantages; algo.name=ppo "
                        f"scores each sample with its critic: disable {_ppo_group_option(cfg)}",
            ("algo.name=ppo", "algo.dynamic_sampling=true")),
    # ---- several policies on one base
    Refusal("policy-named-base", ("train",), lambda cfg: any(p.name == "base" for p in cfg.policies or []),
            # `rlora eval RUN` evaluates the base model under that name beside every policy
            "policies: the name 'base' is reserved for the base model (rlora eval): choose another",
            ("policies=[{name: base}, {name: b}]",)),
    Refusal("one-policy-listed", ("train",), lambda cfg: cfg.policies is not None and len(cfg.policies) < 2,
            lambda cfg: f"policies lists {'one policy' if cfg.policies else 'no policy'}: remove the policies section "
                        "(train.lr / train.seed set a single policy) or list at least two", ("policies=[{name: a}]",)),
    Refusal("policy-named-twice", ("train",), lambda cfg: _duplicate_policy(cfg) is not None,
            lambda cfg: f"policies: the name '{_duplicate_policy(cfg)}' is given twice: every policy needs its own name",
            ("policies=[{name: a}, {name: a}]",)),
    _policies(lambda cfg: cfg.molora is not None, "a molora section", "remove molora (each policy is a plain LoRA "
              "adapter)", MOLORA, "policies-molora"),
    # the output layer by name, before the model loads (models/multi_lora.attach_policies checks the modules too)
    Refusal("policies-output-layer", ("train",),
            lambda cfg: cfg.policies is not None and isinstance(cfg.lora.target_modules, list)
            and "lm_head" in cfg.lora.target_modules,
            "policies: an adapter on 'lm_head' (outside the decoder layers) is not supported: target linear layers "
            "inside the decoder layers", ("policies=[{name: a}, {name: b}]", "lora.target_modules=[q_proj, lm_head]")),
    # ---- a sharded base (train.fsdp)
    Refusal("fsdp-gather-without-fsdp", ("train",),
            lambda cfg: not cfg.train.fsdp and cfg.train.fsdp_gather != "model",
            lambda cfg: f"train.fsdp_gather={cfg.train.fsdp_gather} applies to a sharded base: set train.fsdp=true "
                        "(under torchrun) or remove train.fsdp_gather", ("train.fsdp_gather=layer",)),
    _fsdp("fsdp-quantized", lambda cfg: cfg.model.quantization != "none",
          "train.fsdp does not shard a quantized base: set model.quantization=none or train.fsdp=false",
          ("model.quantization=4bit",)),
    # ---- the launch: how many data-parallel ranks torchrun started
    Refusal("fsdp-one-process", ("train",), lambda cfg, ranks: cfg.train.fsdp and ranks == 1,
            "train.fsdp shards the base across data-parallel ranks: launch with torchrun --nproc_per_node N (N >= 2), "
            "or set train.fsdp=false", ("train.fsdp=true",), launch=True, example_ranks=1),
    Refusal("prompts-per-rank", ("train",), lambda cfg, ranks: cfg.train.prompts_per_step % ranks != 0,
            lambda cfg, ranks: f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the {ranks} "
                               "ranks: each rank samples whole groups",
            ("train.prompts_per_step=3", "train.micro_batch_size=8"), launch=True),
    Refusal("rows-per-rank", ("sft", "rm"), lambda cfg, ranks: cfg.train.batch_size % ranks != 0,
            lambda cfg, ranks: f"train.batch_size={cfg.train.batch_size} must be a multiple of the {ranks} ranks: each "
                               "rank trains its share of every batch",
            ("train.batch_size=3", "train.micro_batch_size=1"), launch=True),
)


def _raise_first(cfg, rows, *args) -> None:
    command = COMMANDS[type(cfg)]
    for row in rows:
        if command in row.commands and row.refused(cfg, *args):
            message = row.message(cfg, *args) if callable(row.message) else row.message
            raise RefusedCombination(row.name, message)


def check_config(cfg) -> None:
    """Raise RefusedCombination for the first row (not a launch row) that refuses this validated config."""
    _raise_first(cfg, [row for row in REFUSALS if not row.launch])


def check_launch(cfg, ranks: int) -> None:
    """Raise RefusedCombination for the first launch row that refuses this config on `ranks` data-parallel ranks."""
    _raise_first(cfg, [row for row in REFUSALS if row.launch], ranks)
