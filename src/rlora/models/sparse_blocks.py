"""transformers' sparse mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router (`gate`) and the
experts. A block flattens its rows' tokens to [tokens, H] before anything inside it runs, so a module in it sees
tokens, not rows: whatever routes by row (several policies, a MoLoRA sequence router) cannot adapt it. And peft
places the LoRA of the fused experts on its own terms (check_layers_kept)."""

from __future__ import annotations

from peft import LoraConfig as PeftLoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.transformers_weight_conversion import _convert_peft_config_moe  # private; peft is pinned below 0.22
from torch import nn

from rlora.errors import UserError


def is_sparse_block(module: nn.Module) -> bool:
    return hasattr(module, "gate") and hasattr(module, "experts")


def peft_expert_parameters(model: nn.Module) -> list[str]:
    """The parameters peft's 'all-linear' adapts in a mixture's sparse blocks (its transformers-4 mapping: the fused
    experts and, on Mixtral, OLMoE and Qwen3-MoE, the router's weight); [] where it adapts none (a dense model,
    Qwen2-MoE). The very names an `rlora train` adapter records: peft loads adapters with target_parameters side by
    side only where they name one set."""
    config = PeftLoraConfig(target_modules="all-linear", task_type="CAUSAL_LM")
    _convert_peft_config_moe(config, model)
    return sorted(config.target_parameters or [])


def sparse_block_names(model: nn.Module) -> list[str]:
    """The names of the model's sparse blocks (as model.named_modules gives them)."""
    return [name for name, module in model.named_modules() if name and is_sparse_block(module)]


def in_sparse_block(name: str, blocks: list[str]) -> str | None:
    """The block of `blocks` (sparse_block_names) that holds the module `name`, or None."""
    return next((block for block in blocks if name.startswith(block + ".")), None)


def check_layers_kept(model: nn.Module, layers: list[int] | None) -> None:
    """Every LoRA module in the decoder layers asked for. peft turns MLP names into the fused experts' parameters of a
    mixture-of-experts model (transformers 5) and places those on every sparse layer, whatever the layer list."""
    found = {int(name.split(".layers.")[1].split(".")[0]) for name, module in model.named_modules()
             if isinstance(module, BaseTunerLayer) and ".layers." in name}
    if layers is not None and found - set(layers):
        raise UserError(f"lora.layers / lora.top_layers: peft also put LoRA on layers {sorted(found - set(layers))} "
                        "(a mixture of experts' expert parameters, which it places on every layer): target maps "
                        "outside the experts, e.g. lora.target_modules=[q_proj, k_proj, v_proj, o_proj]")


def check_all_linear_on_layers(base: nn.Module) -> None:
    """lora.layers / top_layers with 'all-linear' pass peft the names of the layers' linear maps; on a mixture of
    experts that list has no expert (fused parameters, not linear layers), so the experts that 'all-linear' alone
    adapts would silently go untrained."""
    if any(is_sparse_block(module) for module in base.modules()):
        raise UserError("lora.layers / lora.top_layers with lora.target_modules=all-linear on a mixture of experts "
                        "would leave its experts out (peft adapts them only for all-linear, on every layer): list the "
                        "maps to adapt, e.g. lora.target_modules=[q_proj, k_proj, v_proj, o_proj], or drop the layers")
