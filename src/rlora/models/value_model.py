"""PPO's critic on the policy's base: a second LoRA adapter ("value") beside the policy's ("default") on the
same peft model, plus an fp32 value head `nn.Linear(hidden, 1)` on the final hidden state at every
completion position (the state before each completion token). The same design as the reward model
(models/reward_model.py), read per token instead of at the last token.

The value adapter copies the policy's LoRA placement (target modules, layers) with its own rank and alpha.
Outside `Critic.active()` it is frozen (requires_grad False, not active), so the policy's optimizer
parameters, `trainable_parameters(model)` and `save_adapter` see the policy alone.

Saved format (OUTPUT/value_model): the PEFT adapter files (adapter_config.json, adapter_model.safetensors),
value_head.safetensors (weight [1, H], bias [1], float32) and value_model.json (format, version, hidden size,
base model, how values are read)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig

from rlora.errors import UserError, first_line
from rlora.models.beside_mixture import (
    add_beside_mixture, load_beside_mixture, load_plain_weights, save_plain,
)
from rlora.models.frozen_prefix import PrefixSlice
from rlora.models.loading import check_adapter_folder, model_device, read_format_file
from rlora.models.logprobs import completion_hidden
from rlora.models import molora as ml
from rlora.models.named_adapters import adapter_switched
from rlora.models.reward_model import (
    check_hidden_size, hidden_size, load_score_head, new_score_head, save_adapter_and_head,
)
from rlora.types import RolloutSlice

FORMAT = "rlora-value-model"
VERSION = 1
HEAD_FILE = "value_head.safetensors"
META_FILE = "value_model.json"
READS = "before_each_completion_token"  # V_t reads the final hidden state at the position predicting token t
ADAPTER = "value"


@dataclass
class Critic:
    model: torch.nn.Module  # the policy's peft model, which also holds the value adapter
    head: torch.nn.Linear  # fp32 [1, H] + [1]
    adapter_name: str = ADAPTER

    def adapter_parameters(self) -> list[torch.nn.Parameter]:
        return [p for name, p in self.model.named_parameters() if f".{self.adapter_name}." in name]

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the critic's optimizer group holds: the value adapter and the head."""
        return self.adapter_parameters() + list(self.head.parameters())

    @contextmanager
    def active(self, trainable: bool = True):
        """The value adapter active (trainable: its parameters require grad); afterwards the policy's adapter
        again, with every requires_grad and training flag as before. Run forward and backward inside. Beside a
        MoLoRA policy the mixture is off inside: the value model is the base plus the value adapter, as beside a
        LoRA policy, whose adapter the switch turns off."""
        with adapter_switched(self.model, self.adapter_name, trainable=trainable):  # the mixture off too
            yield self

    def values(self, batch: RolloutSlice, prefix: PrefixSlice | None = None) -> torch.Tensor:
        """[B, Tc] float32 V(s_t) at every completion position (0 on padding), on the model's device.
        Call inside `active()`. `prefix`: the frozen lower layers' output (the value adapter sits on the
        policy's layers, so they are the same)."""
        batch = batch.to(model_device(self.model))
        hidden_BTH = completion_hidden(self.model, batch, prefix)
        # contiguous: on a strided view the CPU matmul's rounding depended on the head's storage (a reloaded head
        # gave values 2e-7 apart); on a contiguous copy it does not
        # the head outside any autocast (train.autocast): values, returns and the value loss stay float32
        with torch.autocast(hidden_BTH.device.type, enabled=False):
            values_BT = self.head(hidden_BTH.float().contiguous()).squeeze(-1)
        return values_BT * batch.completion_mask_BTc

    def save(self, folder: Path | str) -> None:
        save_value_model(folder, self.model, self.head, self.adapter_name)

    def restore(self, folder: Path | str) -> None:
        """Put a saved value model's adapter and head weights into this critic (checkpoint resume)."""
        read_value_meta(folder)
        load_plain_weights(self.model, folder, self.adapter_name)  # beside a mixture: into the moved maps
        saved = load_score_head(str(folder), self.head.in_features, model_device(self.model), HEAD_FILE)
        with torch.no_grad():
            self.head.weight.copy_(saved.weight)
            self.head.bias.copy_(saved.bias)


def attach_critic(model, rank: int, alpha: float, head_init_std: float = 0.0, adapter_name: str = ADAPTER,
                  like: str = "default", device: torch.device | None = None) -> Critic:
    """A fresh value adapter (the LoRA placement of the policy adapter `like` with this rank/alpha; B = 0, so it
    starts as the base) beside the policy's on `model`, frozen until `Critic.active()`, and a new value head on
    `device` (default: the model's). Beside a MoLoRA policy the adapter goes on the mixture's base maps
    (models/beside_mixture.py), and `Critic.model` may be a new peft model around `model`: hold on to that one."""
    if ml.has_molora(model):  # the mixture's maps: the policy's placement
        placement = LoraConfig(r=rank, lora_alpha=alpha, target_modules=[name for name, _ in ml.molora_modules(model)])
        model = add_beside_mixture(model, placement, adapter_name)
    else:
        config = dataclasses.replace(model.peft_config[like], r=rank, lora_alpha=alpha, inference_mode=False)
        model.add_adapter(adapter_name, config)
    for name, param in model.named_parameters():
        if f".{adapter_name}." in name:
            param.requires_grad_(False)
    head = new_score_head(hidden_size(model), head_init_std, device or model_device(model))
    return Critic(model, head, adapter_name)


# ---- saving and loading --------------------------------------------------------------------------------

def save_value_model(folder: Path | str, model, head: torch.nn.Linear, adapter_name: str = ADAPTER) -> None:
    """Write the value model into `folder` (the caller makes it atomic, e.g. RunDir.write_folder), under the plain
    base's names also where the adapter sits beside a mixture (it then loads beside a LoRA policy too)."""
    save_adapter_and_head(Path(folder), model, head, adapter_name, HEAD_FILE, META_FILE,
                          {"format": FORMAT, "version": VERSION, "values": READS})
    save_plain(folder, model, adapter_name)


def read_value_meta(folder: Path | str) -> dict:
    """value_model.json of a value folder, checked (UserError with one line when it is not one)."""
    meta_path, meta = read_format_file(folder, META_FILE, FORMAT, "value model",
                                       hint="; `rlora train` with algo.name=ppo writes OUTPUT/value_model")
    if meta.get("version") != VERSION or meta.get("values") != READS:
        raise UserError(f"{meta_path}: unsupported version {meta.get('version')} / values {meta.get('values')!r} "
                        f"(this rlora reads version {VERSION}, values {READS!r})")
    check_adapter_folder(str(folder), key="value model")
    return meta


def load_value_model(folder: Path | str, model, adapter_name: str = ADAPTER, trainable: bool = False) -> Critic:
    """The value model of `folder` attached beside the adapters of the peft `model` (e.g. a policy on the same
    base; beside a MoLoRA policy on the mixture's maps, and `Critic.model` may then be a new peft model around
    `model`), frozen outside `Critic.active()`. A folder built for another base: one-line UserError."""
    size = check_hidden_size(read_value_meta(folder), model, folder, "value model")
    try:
        if ml.has_molora(model):
            model = load_beside_mixture(model, str(folder), adapter_name)
        else:
            model.load_adapter(str(folder), adapter_name=adapter_name, is_trainable=trainable)
    except Exception as err:  # noqa: BLE001 - shape/name mismatch with this base
        raise UserError(f"value model '{folder}' does not fit this base model: {first_line(err)}") from None
    for name, param in model.named_parameters():
        if f".{adapter_name}." in name:
            param.requires_grad_(False)
    head = load_score_head(str(folder), size, model_device(model), HEAD_FILE)
    head.requires_grad_(trainable)
    return Critic(model, head, adapter_name)
