"""The sampler's view of a Llama-family decoder: the model's own modules and weights, arranged for fast
decoding (fused q/k/v and gate/up projections, LoRA merged into *new* tensors).

Nothing here writes to the model. "Merging" builds W + scale * B @ A as a fresh tensor for this sampling
call; the frozen base weights are never touched, so they stay bit-identical however often we merge.
Layers whose LoRA cannot be merged (DoRA and other variants, quantized bases, an already merged peft
layer) are called as modules, which is exactly the trainer's computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from torch import nn

from rlora.models.loading import causal_lm
from rlora.models.multi_lora import PolicyState, packed_lora_delta, policy_state, stacked_factors
from rlora.models.sharded_base import StreamedLayers, sharded_base

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def unsupported_reason(model: nn.Module, max_length: int | None = None) -> str | None:
    """Why the built-in sampler cannot run this model (None: it can)."""
    hf = causal_lm(model)
    config = hf.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type '{config.model_type}' (built-in sampler supports {', '.join(SUPPORTED_MODEL_TYPES)})"
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    uses_window = any(t != "full_attention" for t in layer_types) or (
        config.model_type == "mistral" and window is not None)
    if uses_window and (max_length is None or window is None or max_length > window):
        return "sliding-window attention"
    layer = hf.model.layers[0]
    if not all(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "unexpected attention module layout"
    if not all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "unexpected MLP module layout"
    return None


def _plain_linear(module: nn.Module) -> nn.Linear | None:
    return module if type(module) is nn.Linear and module.weight.dtype.is_floating_point else None


def merged_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of the module's linear map with its active LoRA merged (summed in float32, rounded
    once to the base dtype: equal to the unmerged map up to that rounding), or None when the module must
    be called as is. Returns the base tensors themselves (no copy) when no LoRA is active."""
    plain = _plain_linear(module)
    if plain is not None:
        return plain.weight, plain.bias
    if not hasattr(module, "lora_A") or getattr(module, "merged", False):
        return None
    base = _plain_linear(module.get_base_layer())
    if base is None:
        return None
    if module.disable_adapters:
        return base.weight, base.bias
    active = [name for name in module.active_adapters if name in module.lora_A]
    if any(name in module.lora_variant or module.lora_B[name].bias is not None for name in active):
        return None
    if not active:
        return base.weight, base.bias
    # Sum in float32, round once to the base dtype; a new tensor, the base weight is only read.
    merged = base.weight.float()
    for name in active:
        delta = module.lora_B[name].weight.float() @ module.lora_A[name].weight.float()
        merged = merged + delta * module.scaling[name]
    return merged.to(base.weight.dtype), base.bias


class Cast:
    """Call a module and cast its output to the sampler's compute dtype (a no-op when they agree)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        self.module, self.dtype = module, dtype

    def __call__(self, *args) -> torch.Tensor:
        return self.module(*args).to(self.dtype)


class FusedLinear:
    """Several linear maps of the same input, e.g. q/k/v. Merged: one matmul over concatenated weights
    (in the compute dtype), then split. Otherwise each module is called (peft applies its LoRA unmerged),
    with the input cast to the module's dtype and the output back."""

    def __init__(self, modules: list[nn.Module], merge: bool, dtype: torch.dtype):
        self.sizes = [m.out_features if hasattr(m, "out_features") else m.weight.shape[0] for m in modules]
        self.dtype = dtype
        parts = [merged_weight(m) for m in modules] if merge else [None]
        self.modules = None
        if merge and all(p is not None for p in parts):
            parts = [(w.to(dtype), None if b is None else b.to(dtype)) for w, b in parts]
            weights = [w for w, _ in parts]
            self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
            biases = [b for _, b in parts]
            if all(b is None for b in biases):
                self.bias = None
            else:
                filled = [b if b is not None else w.new_zeros(w.shape[0]) for (w, _), b in zip(parts, biases)]
                self.bias = filled[0] if len(filled) == 1 else torch.cat(filled)
        else:
            self.modules = modules

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.modules is not None:
            return tuple(m(x.to(_weight_dtype(m))).to(self.dtype) for m in self.modules)
        y = F.linear(x, self.weight, self.bias)
        return (y,) if len(self.sizes) == 1 else y.split(self.sizes, dim=-1)


class PolicyFusedLinear:
    """Several linear maps of the same input, on a model with several policy adapters (models/multi_lora.py):
    the base weights fused into one matmul over every row (in the compute dtype), plus each row's own policy
    adapter, batched over the policies. The rows' policies are the state's current RowBlocks, set by the
    sampler before each forward."""

    def __init__(self, modules: list[nn.Module], state: PolicyState, dtype: torch.dtype):
        bases = [m.get_base_layer() if hasattr(m, "lora_A") else m for m in modules]
        self.base = FusedLinear(bases, merge=True, dtype=dtype)
        if self.base.modules is not None:
            raise ValueError("several policies need plain floating-point linear layers under their adapters")
        self.sizes = self.base.sizes
        self.factors = [stacked_factors(m, state.names, dtype) if hasattr(m, "lora_A") else None for m in modules]
        self.state = state

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = self.base(x)
        blocks = self.state.blocks
        packed = blocks.pack(x)
        return tuple(out if f is None else out + blocks.unpack(packed_lora_delta(packed, *map(blocks.select, f)))
                     for out, f in zip(outs, self.factors))


def _weight_dtype(module: nn.Module) -> torch.dtype:
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    weight = getattr(base, "weight", None)
    return weight.dtype if weight is not None and weight.dtype.is_floating_point else torch.float32


@dataclass
class LayerView:
    input_norm: Cast
    qkv: FusedLinear
    o_proj: FusedLinear
    post_norm: Cast
    gate_up: FusedLinear
    down: FusedLinear
    act_fn: nn.Module
    scaling: float

    def release(self) -> None:
        """Drop the fused (merged) weight copies: a streamed layer's view is done with (models/sharded_base.py)."""
        self.qkv = self.o_proj = self.gate_up = self.down = None


def mlp(layer: LayerView, x: torch.Tensor) -> torch.Tensor:
    """The layer's gated MLP on its post-attention norm of x (the residual is the caller's)."""
    gate, up = layer.gate_up(layer.post_norm(x))
    return layer.down(layer.act_fn(gate) * up)[0]


def decode_layers(view: "DecoderView", x_AH: torch.Tensor, cos, sin, attend) -> torch.Tensor:
    """One new token per row through every layer -> logits [A, V]. attend(layer, index, q_AHd, k_AKd,
    v_AKd) stores the key/value and returns the attention output [A, H*d] (the eager and the static decode
    steps differ only there)."""
    A, H, K, d = x_AH.shape[0], view.num_heads, view.num_kv_heads, view.head_dim
    for i, layer in enumerate(view.layers):
        q, k, v = layer.qkv(layer.input_norm(x_AH))
        q, k = apply_rotary_pos_emb(q.view(A, H, 1, d), k.view(A, K, 1, d), cos, sin)
        x_AH = x_AH + layer.o_proj(attend(layer, i, q[:, :, 0], k[:, :, 0], v.view(A, K, d)))[0]
        x_AH = x_AH + mlp(layer, x_AH)
    return view.lm_head(view.norm(x_AH))[0]


@dataclass
class DecoderView:
    embed: Cast
    rotary: nn.Module
    layers: list[LayerView] | StreamedLayers  # iterate once per forward pass
    norm: Cast
    lm_head: FusedLinear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: nn.Module, merge: bool, dtype: torch.dtype | None = None) -> "DecoderView":
        """dtype: the sampler's compute dtype (default: the model's). A lower one, e.g. bfloat16 for a
        float32 model, samples from merged weight copies in that dtype. A model with several policy adapters
        gets each row's own adapter (PolicyFusedLinear; merge does not apply)."""
        hf = causal_lm(model)
        config, inner = hf.config, hf.model
        dtype = dtype or inner.embed_tokens.weight.dtype
        policies = policy_state(model)

        def fused(modules: list[nn.Module]):
            if policies is not None:
                return PolicyFusedLinear(modules, policies, dtype)
            return FusedLinear(modules, merge, dtype)

        def layer_view(layer: nn.Module) -> LayerView:
            attn, mlp = layer.self_attn, layer.mlp
            return LayerView(
                input_norm=Cast(layer.input_layernorm, dtype),
                qkv=fused([attn.q_proj, attn.k_proj, attn.v_proj]),
                o_proj=fused([attn.o_proj]),
                post_norm=Cast(layer.post_attention_layernorm, dtype),
                gate_up=fused([mlp.gate_proj, mlp.up_proj]),
                down=fused([mlp.down_proj]),
                act_fn=mlp.act_fn,
                scaling=attn.scaling,
            )

        sharded = sharded_base(model)
        if sharded is not None and sharded.streams:  # train.fsdp_gather=layer: built in each pass, layer by layer
            layers = StreamedLayers(sharded, layer_view)
        else:
            layers = [layer_view(layer) for layer in inner.layers]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            embed=Cast(inner.embed_tokens, dtype), rotary=inner.rotary_emb, layers=layers, norm=Cast(inner.norm, dtype),
            lm_head=fused([hf.lm_head]), num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=head_dim, dtype=dtype,
            device=inner.embed_tokens.weight.device,
        )
