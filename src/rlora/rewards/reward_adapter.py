"""A reward model of `rlora rm` as a reward function of `rlora train`:
`rewards: [{fn: reward_model, args: {path: runs/rm/reward_model}, weight: 0.5}, {fn: gym}]`.

The reward adapter is loaded beside the policy's adapter ("default") on the policy's own peft model, so the
base weights exist once. It is frozen (requires_grad False, never in the optimizer). Scoring a batch, in
`reward_adapter_active`: no gradient, eval mode (no dropout, no gradient checkpointing), the reward adapter
active; afterwards, also when scoring raises, the policy adapter is active again and every parameter's
requires_grad and every module's training flag are what they were (peft's set_adapter changes both).

Prompt + completion are tokenized as `rlora rm` tokenized its pairs (data/pref_data.encode_parts): the
completion is the assistant turn of the chat template, or without one the prompt's text then the
completion's tokens and EOS. The chat-template setting and system prompt are the reward model's own, read
from the `rlora rm` run's config.yaml beside the folder; without that file the policy run's
data.use_chat_template / data.system_prompt; args.use_chat_template / args.system_prompt override both.
Reward functions get each prompt's text; the scorer maps it back to the example's chat messages (a prompt
given as messages) through the run's prompt sets, so the reward model sees the conversation, roles included.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from rlora.data.pref_data import encode_parts
from rlora.data.prompts import prompt_text
from rlora.errors import UserError
from rlora.models import expert_lora
from rlora.models.loading import resolve_model_path
from rlora.models.named_adapters import adapter_switched, kept_flags
from rlora.models.reward_model import META_FILE, load_reward_model, load_score_head, read_reward_meta, score
from rlora.tensors import right_padded

REWARD_MODEL = "reward_model"  # the `fn` of a reward adapter in rewards[]
_ARGS = {"path": "the folder `rlora rm` wrote (OUTPUT/reward_model)",
         "batch_size": "sequences per scoring pass (default train.micro_batch_size)",
         "use_chat_template": "render prompt + completion with the chat template",
         "system_prompt": "system message added where a prompt has none"}
_UNSET = object()


@dataclass(frozen=True)
class PromptFormat:
    """What pref_data.encode_parts reads from the RM's data config."""

    use_chat_template: bool
    system_prompt: str | None


class RewardAdapter:
    """The callable of one `fn: reward_model` reward: TRL's signature, floats (one per completion).
    Built before the model loads (args and folder checked), usable once `attach` has loaded the adapter."""

    def __init__(self, name: str, folder: str, meta: dict, batch_size: int | None = None,
                 use_chat_template: Any = _UNSET, system_prompt: Any = _UNSET):
        self.name, self.folder, self.meta = name, folder, meta
        self.adapter_name = name  # the peft adapter name: reward_model, reward_model_2, ...
        self.batch_size = batch_size
        self._use_chat_template, self._system_prompt = use_chat_template, system_prompt
        self.model = self.head = self.tokenizer = None
        self.format: PromptFormat | None = None
        self.pad_id = self.eos_id = 0
        self.raw_prompts: dict[str, Any] = {}

    # ---- before the model loads -------------------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec, name: str, index: int) -> "RewardAdapter":
        where = f"reward fn '{REWARD_MODEL}' (rewards[{index}])"
        unknown = sorted(set(spec.args) - set(_ARGS))
        if unknown:
            raise UserError(f"{where}: unknown args.{unknown[0]} (valid: {', '.join(_ARGS)})")
        path = spec.args.get("path")
        if not isinstance(path, str) or not path:
            raise UserError(f"{where} needs args.path: {_ARGS['path']}")
        batch_size = spec.args.get("batch_size")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise UserError(f"{where}: args.batch_size must be a positive integer, not {batch_size!r}")
        use_chat_template = spec.args.get("use_chat_template", _UNSET)
        if use_chat_template is not _UNSET and not isinstance(use_chat_template, bool):
            raise UserError(f"{where}: args.use_chat_template must be true or false, not {use_chat_template!r}")
        system_prompt = spec.args.get("system_prompt", _UNSET)
        if system_prompt is not _UNSET and system_prompt is not None and not isinstance(system_prompt, str):
            raise UserError(f"{where}: args.system_prompt must be text or null, not {system_prompt!r}")
        if not Path(path).is_dir():
            relative = "" if Path(path).is_absolute() else f", relative to the current folder {Path.cwd()}"
            raise UserError(f"{where}: args.path '{path}' is not a folder ({_ARGS['path']}{relative})")
        meta = read_reward_meta(path)  # the description and the adapter files (read through)
        size = meta.get("hidden_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UserError(f"{Path(path) / META_FILE}: hidden_size must be a positive integer, not {size!r}")
        load_score_head(path, size)  # a damaged or misshapen head: now, not after the model loaded
        return cls(name, path, meta, batch_size, use_chat_template, system_prompt)

    def check_base(self, model_path: str) -> None:
        """The reward model must have been trained on the run's base (model.path): one line otherwise."""
        recorded = self.meta.get("base_model")
        if not recorded or _same_model(recorded, model_path):
            return
        raise UserError(f"reward model '{self.folder}' was trained on base '{recorded}', but model.path is "
                        f"'{model_path}': a reward adapter scores on the policy's base, so train it with `rlora rm` "
                        f"model.path={model_path} (the same model in another place: set base_model in "
                        f"{Path(self.folder) / META_FILE})")

    def trained_format(self) -> dict:
        """use_chat_template / system_prompt of the `rlora rm` run that wrote the folder ({}: unknown): its run's
        config.yaml, or for a checkpoint's reward_model/ the config in the checkpoint's state.json."""
        parent = Path(self.folder).parent
        try:
            if (parent / "config.yaml").is_file():
                text = (parent / "config.yaml").read_text(encoding="utf-8")
            else:
                text = json.loads((parent / "state.json").read_text(encoding="utf-8"))["config"]
            data = (yaml.safe_load(text) or {}).get("data")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, yaml.YAMLError, AttributeError):
            return {}
        if not isinstance(data, dict) or "chosen_column" not in data:  # not an `rlora rm` config
            return {}
        return {key: data[key] for key in ("use_chat_template", "system_prompt") if key in data}

    # ---- with the model -------------------------------------------------------------------------------------

    def attach(self, model, tokenizer, pad_id: int, eos_id: int, data_cfg, batch_size: int, examples,
               device: torch.device | None = None):
        """Load the reward adapter beside the policy's on `model` (frozen; the policy's trainable parameters,
        the modules' training flags and the random stream are left as they were) -> the peft model that holds
        it: `model` itself, or a new one around a plain transformers model (`rlora eval` of the base alone).
        device: where its head goes (default: the model's; train.fsdp: the run's, the model being on the CPU)."""
        device = device or next(model.parameters()).device
        with kept_flags(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model, self.head = load_reward_model(self.folder, model, adapter_name=self.adapter_name, device=device)
        for name, param in model.named_parameters():
            if f".{self.adapter_name}." in name:
                param.requires_grad_(False)
        trained = self.trained_format()
        self.format = PromptFormat(
            use_chat_template=_pick(self._use_chat_template, trained.get("use_chat_template", _UNSET),
                                    data_cfg.use_chat_template),
            system_prompt=_pick(self._system_prompt, trained.get("system_prompt", _UNSET), data_cfg.system_prompt))
        self.model, self.tokenizer, self.pad_id, self.eos_id = model, tokenizer, pad_id, eos_id
        self.batch_size = self.batch_size or batch_size
        self.raw_prompts = {prompt_text(ex): ex.prompt for ex in examples if not isinstance(ex.prompt, str)}
        return model

    def sequences(self, prompts: list[str], completions: list[str]) -> list[list[int]]:
        """Token ids of prompt + completion, as `rlora rm` built prompt + response."""
        out = []
        for prompt, completion in zip(prompts, completions):
            prompt_ids, response_ids = encode_parts(self.tokenizer, self.raw_prompts.get(prompt, prompt), completion,
                                                    self.format, self.eos_id)
            out.append(prompt_ids + response_ids)
        return out

    @torch.no_grad()
    def __call__(self, prompts, completions, **_columns) -> list[float]:
        if self.model is None:
            raise UserError(f"reward fn '{REWARD_MODEL}' scores with a reward adapter on the policy's model: "
                            "only `rlora train` and `rlora eval` load it")
        sequences = self.sequences(list(prompts), list(completions))
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths: less padding
        device = next(self.model.parameters()).device
        scores: list[float] = [0.0] * len(sequences)
        with reward_adapter_active(self.model, self.adapter_name):
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                ids, mask = (t.to(device) for t in right_padded([sequences[i] for i in rows], self.pad_id))
                for i, value in zip(rows, score(self.model, self.head, ids, mask).tolist()):
                    scores[i] = value
        return scores


def _pick(explicit, trained, policy):
    """args value, else the reward model's training setting, else the policy run's."""
    if explicit is not _UNSET:
        return explicit
    return policy if trained is _UNSET else trained


def _same_model(recorded: str, model_path: str) -> bool:
    def identity(name: str) -> str:
        path = Path(name).expanduser()
        return str(path.resolve()) if path.exists() else name

    return identity(recorded) in {identity(model_path), identity(resolve_model_path(model_path))}


@contextlib.contextmanager
def reward_adapter_active(model, adapter_name: str):
    """The model with `adapter_name` active, in eval mode; then the adapter that was active before (the
    policy's), with the parameters' requires_grad and the modules' training flags as they were. Beside a MoLoRA
    policy the mixture is off inside: the reward model is the base plus its adapter."""
    with adapter_switched(model, adapter_name):  # beside a MoLoRA policy the mixture off too
        model.eval()
        yield model


# ---- wiring into `rlora train` -------------------------------------------------------------------------------

def reward_adapters(rewards) -> list[RewardAdapter]:
    return [reward.fn for reward in rewards if isinstance(reward.fn, RewardAdapter)]


def check_reward_adapters(rewards, model_path: str) -> None:
    """Before the model loads: each reward model's base is model.path."""
    for adapter in reward_adapters(rewards):
        adapter.check_base(model_path)


def attach_reward_adapters(rewards, model, tokenizer, tok, cfg, prompt_sets, batch_size: int | None = None,
                           device: torch.device | None = None):
    """Load every reward adapter of the run onto the policy's peft model (or a plain base: wrapped in a new peft
    model) -> the model that holds them. batch_size: the scoring batch where args.batch_size is not set
    (default train.micro_batch_size). device: where their heads go (default: the model's)."""
    examples = list(prompt_sets.train) + list(prompt_sets.eval)
    for adapter in reward_adapters(rewards):
        model = adapter.attach(model, tokenizer, tok.pad_id, tok.eos_ids[0], cfg.data,
                               batch_size or cfg.train.micro_batch_size, examples, device)
    expert_lora.install(model)  # a reward adapter's own experts wrappers (on a plain base, or beside attention LoRA)
    return model
