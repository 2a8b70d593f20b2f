"""transformers' sparse mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router (`gate`) and the
experts. A block flattens its rows' tokens to [tokens, H] before anything inside it runs, so a module in it sees
tokens, not rows: whatever routes by row (several policies, a MoLoRA sequence router) cannot adapt it. And peft
places the LoRA of the fused experts on its own terms (check_layers_kept)."""

from __future__ import annotations

from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from rlora.errors import UserError


def is_sparse_block(module: nn.Module) -> bool:
    return hasattr(module, "gate") and hasattr(module, "experts")


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The experts' fused weights ('experts.gate_up_proj', 'experts.down_proj': [experts, out, in]) of the model's
    sparse blocks, as peft target_parameters name them; [] for a dense model."""
    return sorted({f"experts.{name}" for module in model.modules() if is_sparse_block(module)
                   for name, param in module.experts.named_parameters(recurse=False) if param.dim() == 3})


def sparse_block_of(model: nn.Module, name: str) -> str | None:
    """The name of the sparse block that holds the module `name` (names as model.named_modules gives them), or None."""
    blocks = [block for block, module in model.named_modules() if block and is_sparse_block(module)]
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
