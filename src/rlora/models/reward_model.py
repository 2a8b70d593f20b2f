"""A reward model on the shared base: a LoRA adapter plus a scalar score head (fp32 `nn.Linear(hidden, 1)`)
that reads the decoder's last hidden state (after the final norm) at the last real token of each sequence.

Saved format (docs/reward_models.md): the PEFT adapter files (adapter_config.json, adapter_model.safetensors),
score_head.safetensors (weight [1, H], bias [1], float32) and reward_model.json (format, version, hidden
size, base model, how the score is read)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from rlora.errors import UserError, first_line
from rlora.models import molora as ml
from rlora.models.beside_mixture import load_beside_mixture
from rlora.models.loading import causal_lm, check_adapter_folder, read_format_file

FORMAT = "rlora-reward-model"
VERSION = 1
HEAD_FILE = "score_head.safetensors"
META_FILE = "reward_model.json"
READS = "last_real_token"  # the hidden state at the last position whose attention_mask is 1


def new_score_head(hidden_size: int, init_std: float = 0.0, device: torch.device | str = "cpu") -> torch.nn.Linear:
    """fp32 Linear(hidden, 1); weight ~ N(0, init_std) (zeros when 0), bias 0."""
    head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32, device=device)
    with torch.no_grad():
        head.weight.normal_(0.0, init_std) if init_std > 0 else head.weight.zero_()
        head.bias.zero_()
    return head


def hidden_size(model: torch.nn.Module) -> int:
    return causal_lm(model).config.hidden_size


def last_token_index(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] position of the last 1 in each row of the mask (right or left padding alike)."""
    positions_T = torch.arange(attention_mask_BT.shape[1], device=attention_mask_BT.device)
    return (attention_mask_BT.long() * positions_T).argmax(-1)


def last_hidden(model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """[B, T, H] final hidden states of the decoder (with the active adapter; no vocabulary projection)."""
    decoder = causal_lm(model).get_decoder()
    return decoder(input_ids=input_ids_BT, attention_mask=attention_mask_BT).last_hidden_state


def score(model: torch.nn.Module, head: torch.nn.Linear, input_ids_BT: torch.Tensor,
          attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] float32 rewards: head(hidden state at each row's last real token). Batches are right-padded by
    rlora; left padding picks the right token too, but shifts Llama's positions (a slightly different score)."""
    hidden_BTH = last_hidden(model, input_ids_BT, attention_mask_BT)
    rows_B = torch.arange(hidden_BTH.shape[0], device=hidden_BTH.device)
    hidden_BH = hidden_BTH[rows_B, last_token_index(attention_mask_BT)]
    return head(hidden_BH.float()).squeeze(-1)


# ---- saving and loading --------------------------------------------------------------------------------

def save_reward_model(folder: Path | str, model, head: torch.nn.Linear, adapter_name: str = "default") -> None:
    """Write the reward model into `folder` (the caller makes it atomic, e.g. RunDir.write_folder)."""
    save_adapter_and_head(Path(folder), model, head, adapter_name, HEAD_FILE, META_FILE,
                          {"format": FORMAT, "version": VERSION, "score": READS})


def save_adapter_and_head(folder: Path, model, head: torch.nn.Linear, adapter_name: str, head_file: str,
                          meta_file: str, description: dict) -> None:
    """The named adapter's PEFT files at the top of `folder`, the fp32 head as `head_file` (weight, bias) and
    `meta_file`: `description` (format, version, how the head is read) plus the base's hidden size, name and
    type and the head's shapes."""
    model.save_pretrained(str(folder), safe_serialization=True, selected_adapters=[adapter_name])
    if adapter_name != "default":  # peft writes named adapters into a subfolder
        for child in (folder / adapter_name).iterdir():
            child.replace(folder / child.name)
        (folder / adapter_name).rmdir()
    save_file({"weight": head.weight.detach().float().cpu().contiguous(),
               "bias": head.bias.detach().float().cpu().contiguous()}, str(folder / head_file))
    lm = causal_lm(model)
    size = lm.config.hidden_size
    meta = {**description, "hidden_size": size, "base_model": getattr(lm.config, "_name_or_path", None),
            "model_type": lm.config.model_type,
            "head": {"file": head_file, "weight": [1, size], "bias": [1], "dtype": "float32"}}
    (folder / meta_file).write_text(json.dumps(meta, indent=2) + "\n")


def check_hidden_size(meta: dict, model, folder, what: str) -> int:
    """-> the model's hidden size, which must be the one the folder's head was built for (one-line UserError)."""
    size = hidden_size(model)
    if meta.get("hidden_size") != size:
        raise UserError(f"{what} '{folder}' was built for a base with hidden size {meta.get('hidden_size')} "
                        f"({meta.get('base_model')}); this base has {size}: load it on its own base model")
    return size


def read_reward_meta(folder: str) -> dict:
    """reward_model.json of a reward folder, checked (UserError with one line when it is not one)."""
    path = Path(folder)
    meta_path, meta = read_format_file(folder, META_FILE, FORMAT, "reward model",
                                       hint="; `rlora rm` writes OUTPUT/reward_model")
    if meta.get("version") != VERSION or meta.get("score") != READS:
        raise UserError(f"{meta_path}: unsupported version {meta.get('version')} / score {meta.get('score')!r} "
                        f"(this rlora reads version {VERSION}, score {READS!r})")
    check_adapter_folder(folder, key="reward model")
    if not (path / HEAD_FILE).is_file():
        raise UserError(f"reward model '{folder}' has no {HEAD_FILE}")
    return meta


def load_score_head(folder: str, size: int, device: torch.device | str = "cpu",
                    head_file: str = HEAD_FILE) -> torch.nn.Linear:
    """The fp32 Linear(size, 1) saved as `head_file` in `folder`, frozen (one-line UserError if damaged)."""
    try:
        tensors = load_file(str(Path(folder) / head_file))
    except Exception as err:  # noqa: BLE001 - truncated or not safetensors
        raise UserError(f"{Path(folder) / head_file} is damaged: {first_line(err)}") from None
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None or bias is None or tuple(weight.shape) != (1, size) or tuple(bias.shape) != (1,):
        raise UserError(f"{Path(folder) / head_file} must hold weight [1, {size}] and bias [1]")
    head = new_score_head(size, device=device)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    head.requires_grad_(False)
    return head


def load_reward_model(folder: str, base_model, adapter_name: str = "reward", device: torch.device | None = None):
    """(model, head): the reward adapter of `folder` attached to `base_model` under `adapter_name`, frozen.

    `base_model` is a plain transformers causal LM (-> a new PeftModel whose active adapter is the reward one)
    or an existing peft model, e.g. the policy (-> `load_adapter` adds it beside the others; call
    `model.set_adapter(adapter_name)` before `score`), or a MoLoRA model or a peft model around one (-> the adapter
    on the mixture's base maps, models/beside_mixture.py: score inside `adapter_switched`, which turns the mixture off).
    A folder built for another base: one-line UserError. The head goes to `device` (default: the model's)."""
    size = check_hidden_size(read_reward_meta(folder), base_model, folder, "reward model")
    try:
        if ml.has_molora(base_model):  # beside a MoLoRA policy: on the mixture's base maps, off until scoring
            model = load_beside_mixture(base_model, folder, adapter_name)
        elif isinstance(base_model, PeftModel):
            base_model.load_adapter(folder, adapter_name=adapter_name, is_trainable=False)
            model = base_model
        else:
            model = PeftModel.from_pretrained(base_model, folder, adapter_name=adapter_name, is_trainable=False)
    except Exception as err:  # noqa: BLE001 - shape/name mismatch with this base
        raise UserError(f"reward model '{folder}' does not fit this base model: {first_line(err)}") from None
    return model, load_score_head(folder, size, device or next(model.parameters()).device)
