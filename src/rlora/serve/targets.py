"""What a training client's LoRA adapts on the base (Tinker's train_attn / train_mlp / train_unembed), and whether
its adapter can join a batched forward_backward pass (serve/batched.py)."""

from __future__ import annotations

from peft import LoraConfig
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from rlora.models.loading import linear_module_names
from rlora.models.block_routing import token_routable
from rlora.models.sparse_blocks import in_sparse_block, peft_expert_parameters, sparse_block_names
from rlora.serve import wire
from rlora.serve.state import ServeError

LORA_ALPHA = 32  # Tinker's LoRA scale: alpha 32 whatever the rank


class ClientTargets:
    """The base's maps by role, found once per server."""

    def __init__(self, base: nn.Module):
        self.attn = linear_module_names(base, ".self_attn.")
        self.mlp = linear_module_names(base, ".mlp.")
        # a mixture of experts: train_mlp adapts what peft's all-linear adapts in its sparse blocks (the experts'
        # fused weights, a router's), beside the MLPs' linear maps (dense layers, shared experts)
        self.expert_parameters = peft_expert_parameters(base)
        self.sparse_blocks = sparse_block_names(base)

    def first(self) -> list[str]:
        """One linear map, for the server's idle adapter."""
        return (self.attn or self.mlp)[:1]

    def config(self, spec: wire.LoraSpec) -> LoraConfig:
        modules = ((self.attn if spec.train_attn else []) + (self.mlp if spec.train_mlp else [])
                   + (["lm_head"] if spec.train_unembed else []))
        parameters = self.expert_parameters if spec.train_mlp else []
        if not modules and not parameters:
            raise ServeError(400, "lora_config: train_attn, train_mlp and train_unembed are all off: nothing to train")
        return LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=modules or None,
                          target_parameters=parameters or None, bias="none", task_type="CAUSAL_LM")

    def routable(self, model: nn.Module, adapter: str) -> bool:
        """Whether the adapter can join a batched pass (model: the peft model that holds it): a layer of it inside a
        mixture-of-experts block sees the block's tokens, not rows, which routed_adapters sends through their rows'
        adapters only for the layers it knows there (models/block_routing.token_routable; experts on a CPU)."""
        for name, module in model.named_modules():
            block = in_sparse_block(name.removeprefix("base_model.model."), self.sparse_blocks)
            if block is None or adapter not in getattr(module, "lora_A", {}):
                continue
            within = model.get_submodule(f"base_model.model.{block}")
            if not token_routable(module, within):
                return False
            # experts on a GPU: its loop against transformers' grouped kernel is not measured (models/expert_lora.py)
            if isinstance(module, ParamWrapper) and module.num_experts > 1 and module.get_param().device.type != "cpu":
                return False
        return True
