"""Peft adapters beside a MoLoRA policy: PPO's value adapter and reward adapters on the base the mixture adapts.

A MoLoRA layer (models/molora/layer.py) wraps its base linear map and calls it in its forward; a peft LoRA goes on
that map (`<layer>.base_layer`), where peft can wrap an `nn.Linear`. Peft's adapter layers stay switched off outside
their own passes (named_adapters.adapter_switched turns them on there, and the mixture off): the policy computes
the mixture alone, each other role the base plus its own adapter, as beside a LoRA policy. The samplers call MoLoRA layers as modules (never merged), so they sample the mixture alone as well.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists
from safetensors.torch import load_file, save_file
from torch import nn

from rlora.errors import UserError
from rlora.models import molora as ml
from rlora.models.loading import causal_lm
from rlora.models.named_adapters import kept_flags

PEFT_PREFIX = "base_model.model."  # where peft's saved weight names start


def add_beside_mixture(model: nn.Module, config: LoraConfig, adapter_name: str) -> PeftModel:
    """Add the peft LoRA `config` as `adapter_name` to a MoLoRA model (-> a new peft model around it) or to the peft
    model already around one (-> that one), each target that is a MoLoRA layer moved to its base map. Every existing
    parameter keeps its requires_grad (peft would freeze the mixture), the new adapter's are frozen, and peft's
    adapter layers are switched off."""
    config = dataclasses.replace(config, target_modules=_placement(model, config), layers_to_transform=None,
                                 layers_pattern=None, inference_mode=False)
    with kept_flags(model):
        if isinstance(model, PeftModel):
            model.add_adapter(adapter_name, config)
        else:
            model = get_peft_model(model, config, adapter_name=adapter_name)
    for name, param in model.named_parameters():
        if f".{adapter_name}." in name:
            param.requires_grad_(False)
    model.base_model.disable_adapter_layers()
    return model


def load_beside_mixture(model: nn.Module, folder: str, adapter_name: str) -> PeftModel:
    """A saved peft LoRA (folder: adapter_config.json, adapter_model.safetensors, under the plain base's names, as
    `rlora rm` and `save_plain` write them) added beside the mixture as `adapter_name` (add_beside_mixture), its
    weights put into the moved maps. A folder that does not fit this model: one-line UserError."""
    model = add_beside_mixture(model, LoraConfig.from_pretrained(folder), adapter_name)
    load_plain_weights(model, folder, adapter_name)
    return model


def load_plain_weights(model: PeftModel, folder: Path | str, adapter_name: str) -> None:
    """The weights of a saved peft LoRA (plain base names) into the adapter `adapter_name` of `model`, renamed to
    the maps it was moved to where it sits beside a mixture. A folder that does not fit: one-line UserError."""
    moved = _moved(model, adapter_name)
    weights = {_moved_key(key, moved): value for key, value in load_file(str(Path(folder) / "adapter_model.safetensors"))
               .items()}
    result = set_peft_model_state_dict(model, weights, adapter_name=adapter_name)
    missing = [key for key in result.missing_keys if f".{adapter_name}." in key]
    if result.unexpected_keys or missing:
        raise UserError(f"adapter '{folder}' does not fit this model ({(result.unexpected_keys or missing)[0]})")


def save_plain(folder: Path | str, model: PeftModel, adapter_name: str) -> None:
    """Rewrite the peft files that `model.save_pretrained` wrote into `folder` for `adapter_name` under the plain
    base's names (a map moved into a MoLoRA layer named as the layer itself), so that the folder loads like any
    adapter of this base, beside a LoRA policy or beside a mixture (load_beside_mixture). A no-op for an adapter
    that sits on no MoLoRA layer."""
    moved = _moved(model, adapter_name)
    if not moved:
        return
    folder = Path(folder)
    config = LoraConfig.from_pretrained(str(folder))
    config.target_modules = sorted(name.removesuffix(".base_layer") for name in config.target_modules)
    config.save_pretrained(str(folder))
    weights = load_file(str(folder / "adapter_model.safetensors"))
    plain = {_plain_key(key, moved): value for key, value in weights.items()}
    save_file(plain, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def _placement(model: nn.Module, config: LoraConfig) -> list[str]:
    """The module names (in the causal LM) that `config` selects, a MoLoRA layer's replaced by its base map's."""
    names = []
    for name, module in causal_lm(model).named_modules():
        if name.endswith(".base_layer") or not isinstance(module, (nn.Linear, ml.MoLoRALinear, BaseTunerLayer)):
            continue  # a base map inside a MoLoRA or peft layer is chosen through the layer itself
        if ml.PARAM_TAG in name:
            continue  # a MoLoRA router (an nn.Linear) is the mixture's, whatever pattern the targets are
        if check_target_module_exists(config, name):
            names.append(f"{name}.base_layer" if isinstance(module, ml.MoLoRALinear) else name)
    if not names:
        raise UserError(f"the adapter's target_modules {config.target_modules!r} select no linear layer of this model")
    return names


def _moved(model: nn.Module, adapter_name: str) -> list[str]:
    """The MoLoRA layers whose base map holds the adapter (none where the model has no such adapter placement)."""
    targets = model.peft_config[adapter_name].target_modules if hasattr(model, "peft_config") else []
    return [name.removesuffix(".base_layer") for name in targets or [] if name.endswith(".base_layer")]


def _plain_key(key: str, moved: list[str]) -> str:
    """_moved_key's inverse."""
    for name in moved:
        if key.startswith(f"{PEFT_PREFIX}{name}.base_layer.lora_"):
            return key.replace(f"{PEFT_PREFIX}{name}.base_layer.", f"{PEFT_PREFIX}{name}.", 1)
    return key


def _moved_key(key: str, moved: list[str]) -> str:
    """A saved weight name of the plain base's layer `m` (base_model.model.m.lora_A.weight) -> the name it has where
    m is a MoLoRA layer (base_model.model.m.base_layer.lora_A.weight)."""
    for name in moved:
        if key.startswith(f"{PEFT_PREFIX}{name}.lora_"):
            return key.replace(f"{PEFT_PREFIX}{name}.", f"{PEFT_PREFIX}{name}.base_layer.", 1)
    return key
