"""A Hugging Face causal LM carrying MoLoRA layers: attaching them, finding them, and the routing context that
every layer of the model reads (the prompt summaries of a sequence router, the mixture off)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

from rlora.config import MoLoRAConfig
from rlora.errors import UserError
from rlora.models.loading import causal_lm, skeleton
from rlora.models.molora.layer import PARAM_TAG, MoLoRALinear
from rlora.models.molora.routing import RoutingState
from rlora.models.sparse_blocks import in_sparse_block, sparse_block_names


def molora_modules(model: nn.Module) -> list[tuple[str, MoLoRALinear]]:
    """(name relative to the causal LM, module) of every MoLoRA layer, in module order."""
    return [(name, m) for name, m in causal_lm(model).named_modules() if isinstance(m, MoLoRALinear)]


def has_molora(model: nn.Module) -> bool:
    return bool(molora_modules(model))


def routing_state(model: nn.Module) -> RoutingState:
    """The model's shared routing state (a MoLoRALinear on its own: its own)."""
    if isinstance(model, MoLoRALinear):
        return model.state
    modules = molora_modules(model)
    if not modules:
        raise RuntimeError("this model has no MoLoRA layers (attach_molora or load_molora first)")
    return modules[0][1].state


def sequence_routed(model: nn.Module) -> bool:
    """The model carries MoLoRA layers with a sequence router (its forwards need the prompts)."""
    modules = molora_modules(model)
    return bool(modules) and modules[0][1].config.router == "sequence"


def aux_losses_on(model: nn.Module) -> bool:
    """The model carries MoLoRA layers whose auxiliary losses have a weight (they then cover every row)."""
    modules = molora_modules(model)
    return bool(modules) and (modules[0][1].config.balance_coef > 0 or modules[0][1].config.z_coef > 0)


# ---- the routing context ---------------------------------------------------------------------------------

def prompt_summary(model: nn.Module, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B, D] float32: per prompt, the mean of the base's input embeddings of its tokens (no padding). Each
    row is computed from its own tokens alone, so the same prompt gives the same bits in any batch."""
    embed = causal_lm(model).get_input_embeddings()
    device = embed.weight.device
    rows = []
    with torch.no_grad():
        for ids in prompts:
            if len(ids) == 0:
                raise ValueError("MoLoRA sequence routing: an empty prompt has no summary")
            rows.append(embed(torch.as_tensor(list(ids), dtype=torch.long, device=device)).float().mean(0))
    return torch.stack(rows)


def prompt_summary_padded(model: nn.Module, prompt_ids_BT: torch.Tensor, prompt_mask_BT: torch.Tensor) -> torch.Tensor:
    """prompt_summary of padded prompts (left or right padding; mask 1 = prompt token)."""
    keep_BT = prompt_mask_BT.bool()
    return prompt_summary(model, [ids[keep].tolist() for ids, keep in zip(prompt_ids_BT, keep_BT)])


def set_sequence_routing(model: nn.Module, summary_BD: torch.Tensor | None) -> None:
    """Route the next forwards' B rows by these prompt summaries (None: unset)."""
    routing_state(model).summary_BD = summary_BD


@contextmanager
def _state_set(model: nn.Module, field: str, value):
    """The model's routing state with `field` = value inside; the previous value is restored on exit."""
    state = routing_state(model)
    previous = getattr(state, field)
    setattr(state, field, value)
    try:
        yield value
    finally:
        setattr(state, field, previous)


@contextmanager
def sequence_routing(model: nn.Module, summary_BD: torch.Tensor):
    """Forwards inside route row b by summary_BD[b]; the previous setting is restored on exit."""
    with _state_set(model, "summary_BD", summary_BD):
        yield summary_BD


@contextmanager
def routing_from_prompts(model: nn.Module, prompts: Sequence[Sequence[int]]):
    """sequence_routing with prompt_summary(model, prompts)."""
    with sequence_routing(model, prompt_summary(model, prompts)) as summary_BD:
        yield summary_BD


@contextmanager
def molora_disabled(model: nn.Module):
    """The base alone (every expert off), e.g. the reference policy."""
    with _state_set(model, "disabled", True):
        yield model


# ---- attaching ---------------------------------------------------------------------------------------------

def check_molora_targets(config: MoLoRAConfig, path: str, trust_remote_code: bool = False) -> None:
    """molora.target_modules naming no linear layer of the model's decoder layers, refused before its weights load
    (as attaching would after)."""
    bare = skeleton(path, trust_remote_code)
    if bare is not None:
        target_names(bare, config.target_modules)


def target_names(model: nn.Module, targets: str | list[str]) -> list[str]:
    """Names of the linear layers inside decoder layers that `targets` selects."""
    linears = [name for name, m in causal_lm(model).named_modules() if isinstance(m, nn.Linear) and ".layers." in name]
    if targets == "all-linear":
        chosen = linears
    else:
        chosen = [name for name in linears if name.rsplit(".", 1)[-1] in targets]
        missing = sorted(set(targets) - {name.rsplit(".", 1)[-1] for name in chosen})
        if missing:
            available = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise UserError(f"MoLoRA target_modules {missing} match no linear layer in the decoder layers "
                            f"(available: {', '.join(available)})")
    if not chosen:
        raise UserError("MoLoRA target_modules select no linear layer inside the decoder layers")
    return chosen


def check_bare(model: nn.Module) -> None:
    """A one-line UserError unless the model is a bare base (no peft adapter, no MoLoRA yet)."""
    if hasattr(model, "peft_config"):
        raise UserError("MoLoRA attaches to the bare base model, not to one that already carries a peft adapter")
    if molora_modules(model):
        raise UserError("this model already carries MoLoRA layers")


def _check_attachable(model: nn.Module, names: list[str], router: str) -> None:
    check_bare(model)
    lm = causal_lm(model)
    blocks = sparse_block_names(lm)
    for name in names:
        module = lm.get_submodule(name)
        if not (_plain_linear(module) or _bitsandbytes_linear(module)):
            raise UserError(f"MoLoRA cannot wrap '{name}' ({type(module).__name__}): it adapts floating-point linear "
                            "layers and bitsandbytes' 4-bit and 8-bit ones (model.quantization)")
        if router == "sequence" and in_sparse_block(name, blocks) is not None:
            raise UserError(f"MoLoRA's sequence router cannot route '{name.split('.mlp.')[-1]}': it sits inside a "
                            "mixture-of-experts block, which runs tokens, not rows; use molora.router=token, or "
                            "target the attention maps: molora.target_modules=[q_proj, k_proj, v_proj, o_proj]")


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.weight.dtype.is_floating_point


def _bitsandbytes_linear(module: nn.Module) -> bool:
    """A layer of model.quantization (bitsandbytes' Linear4bit / Linear8bitLt), which the mixture calls as a module,
    as peft's LoRA does; not other quantized linear layers (fp8, metal, ...), whose backward rlora does not test."""
    kind = type(module)
    return kind.__module__.startswith("bitsandbytes.") and kind.__name__ in ("Linear4bit", "Linear8bitLt")


def attach_modules(model: nn.Module, config: MoLoRAConfig, names: list[str]) -> list[nn.Parameter]:
    """Replace exactly these linear layers (names relative to the causal LM) by fresh MoLoRALinear sharing one
    routing state, freeze everything else; -> the MoLoRA parameters."""
    _check_attachable(model, names, config.router)
    lm = causal_lm(model)
    lm.requires_grad_(False)
    state = RoutingState(config)
    summary_dim = lm.get_input_embeddings().embedding_dim
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = lm.get_submodule(parent_name)
        setattr(parent, child, MoLoRALinear(getattr(parent, child), config, state, summary_dim))
    return [p for n, p in lm.named_parameters() if PARAM_TAG in n]


def attach_molora(model: nn.Module, config: MoLoRAConfig) -> list[nn.Parameter]:
    """Replace the target linear layers of a Hugging Face causal LM (in place) by MoLoRALinear, freeze
    everything else; returns the trainable parameters (experts and routers)."""
    check_bare(model)
    return attach_modules(model, config, target_names(model, config.target_modules))
