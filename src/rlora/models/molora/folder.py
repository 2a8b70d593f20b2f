"""The saved MoLoRA folder: molora_config.json (format, version, config, base, module names) and
molora_model.safetensors (float32 experts and routers, named as the parameters relative to the causal LM).
Loading checks everything before it changes the model; each problem is one UserError line. docs/molora.md has
the format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from torch import nn

from rlora.config import MoLoRAConfig
from rlora.errors import UserError, first_line
from rlora.models.loading import causal_lm, read_format_file
from rlora.models.molora.layer import PARAM_TAG
from rlora.models.molora.model import attach_modules, check_bare, molora_modules, routing_state

FORMAT = "rlora-molora"
VERSION = 1
CONFIG_FILE = "molora_config.json"
WEIGHTS_FILE = "molora_model.safetensors"


def _router_input(config: MoLoRAConfig) -> str:
    return ("rms-normalised input of the module, per token" if config.router == "token"
            else "rms-normalised mean input embedding of the prompt tokens, per sequence")


def save_molora(model: nn.Module, folder: Path | str) -> None:
    """Write molora_config.json and molora_model.safetensors into `folder` (created if missing; the caller
    makes it atomic). Tensor names are the parameter names relative to the causal LM."""
    config = routing_state(model).config
    lm = causal_lm(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().float().cpu().contiguous() for n, p in lm.named_parameters() if PARAM_TAG in n}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {
        "format": FORMAT, "version": VERSION, "config": config.model_dump(),
        "base_model": getattr(lm.config, "_name_or_path", None), "model_type": lm.config.model_type,
        "hidden_size": lm.get_input_embeddings().embedding_dim, "router_input": _router_input(config),
        "modules": [name for name, _ in molora_modules(model)],
        "weights": {"file": WEIGHTS_FILE, "dtype": "float32",
                    "tensors": "<module>.molora_A [E, r, in] ([r, in] with hydra), <module>.molora_B [E, out, r], "
                               "<module>.molora_router.weight [E, in] (token) or [E, hidden_size] (sequence)"},
    }
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_molora_meta(folder: str | Path) -> tuple[dict, MoLoRAConfig]:
    """(molora_config.json, its config) of a MoLoRA folder, checked: a one-line UserError when it is not one."""
    path = Path(folder)
    meta_path, meta = read_format_file(folder, CONFIG_FILE, FORMAT, "MoLoRA adapter")
    if meta.get("version") != VERSION:
        raise UserError(f"{meta_path}: unsupported version {meta.get('version')} (this rlora reads version {VERSION})")
    try:
        config = MoLoRAConfig.model_validate(meta.get("config"))
    except ValidationError as err:
        detail = err.errors()[0]
        raise UserError(f"{meta_path}: bad config ({'.'.join(map(str, detail['loc']))}: {detail['msg']})") from None
    modules = meta.get("modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise UserError(f"{meta_path}: 'modules' must be a non-empty list of module names")
    if not (path / WEIGHTS_FILE).is_file():
        raise UserError(f"MoLoRA folder '{folder}' has no {WEIGHTS_FILE}")
    return meta, config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 - truncated or not safetensors
        raise UserError(f"{path} is damaged (truncated or not safetensors): {first_line(err)}") from None


def expected_shapes(model: nn.Module, config: MoLoRAConfig, names: list[str]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} that MoLoRA on these modules of this (bare) model has."""
    lm = causal_lm(model)
    E, r = config.num_experts, config.rank
    hidden = lm.get_input_embeddings().embedding_dim
    shapes = {}
    for name in names:
        try:
            module = lm.get_submodule(name)
        except AttributeError:
            raise UserError(f"MoLoRA module '{name}' does not exist in this model (built for another base?)") from None
        if not isinstance(module, nn.Linear):
            raise UserError(f"MoLoRA module '{name}' is a {type(module).__name__} in this model, not a linear layer")
        i, o = module.in_features, module.out_features
        shapes[f"{name}.molora_A"] = (r, i) if config.hydra else (E, r, i)
        shapes[f"{name}.molora_B"] = (E, o, r)
        shapes[f"{name}.molora_router.weight"] = (E, i if config.router == "token" else hidden)
    return shapes


def _check_tensors(folder, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise UserError(f"MoLoRA folder '{folder}': {WEIGHTS_FILE} lacks {len(missing)} and has {len(extra)} "
                        f"unexpected tensors (first: {(missing + extra)[0]})")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise UserError(f"MoLoRA folder '{folder}' does not fit this base model: {name} is "
                            f"{list(tensors[name].shape)}, this base needs {list(shape)}")


def load_molora(model: nn.Module, folder: str | Path, trainable: bool = False) -> list[nn.Parameter]:
    """Attach the MoLoRA saved in `folder` to a bare base (in place) with exactly its weights; returns its
    parameters (trainable: requires_grad on). Everything is checked before the model is changed."""
    meta, config = read_molora_meta(folder)
    check_bare(model)
    hidden = causal_lm(model).get_input_embeddings().embedding_dim
    if meta.get("hidden_size") != hidden:
        raise UserError(f"MoLoRA folder '{folder}' was built for a base with hidden size {meta.get('hidden_size')} "
                        f"({meta.get('base_model')}); this base has {hidden}: load it on its own base model")
    names = meta["modules"]
    tensors = _read_tensors(Path(folder) / WEIGHTS_FILE)
    _check_tensors(folder, tensors, expected_shapes(model, config, names))
    params = attach_modules(model, config, names)
    lm = causal_lm(model)
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if PARAM_TAG in name:
                param.copy_(tensors[name])
                param.requires_grad_(trainable)
    return params
