"""The sampler's view of a decoder (the families of rollout/layouts.py): the model's own modules and weights,
arranged for fast decoding (fused q/k/v and gate/up projections, LoRA merged into *new* tensors).

Nothing here writes to the model. "Merging" builds W + scale * B @ A as a fresh tensor for this sampling
call; the frozen base weights are never touched, so they stay bit-identical however often we merge.
Layers whose LoRA cannot be merged (DoRA and other variants, quantized bases, an already merged peft
layer) are called as modules, which is exactly the trainer's computation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from rlora.models.loading import causal_lm, reachable_window
from rlora.models.multi_lora import PolicyState, packed_lora_delta, policies_disabled, policy_state, stacked_factors
from rlora.models.sharded_base import StreamedLayers, sharded_base
from rlora.models.sparse_blocks import is_sparse_block
from rlora.rollout.layouts import LAYOUTS, SUPPORTED_MODEL_TYPES, Layout, layout_refusal
from rlora.rollout.packed import PackCache, PackedLinear, linear_parts

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderView", "LayerView", "decode_layers", "unsupported_reason"]


def unsupported_reason(model: nn.Module, max_length: int | None = None) -> str | None:
    """Why the built-in sampler cannot run this model (None: it can)."""
    hf = causal_lm(model)
    config = hf.config
    reason = layout_refusal(config.model_type, config, max_length)
    if reason is not None:
        return reason
    layout = LAYOUTS[config.model_type]
    layer = hf.model.layers[0]
    attention_parts = (*layout.qkv, "o_proj") + (("q_norm", "k_norm") if layout.qk_norm else ())
    if not all(hasattr(layer.self_attn, n) for n in attention_parts):
        return "unexpected attention module layout"
    if not all(_gated(l.mlp, layout) or (layout.moe and is_sparse_block(l.mlp)) for l in hf.model.layers):
        return "unexpected MLP module layout"
    if not all(hasattr(layer, n) for n in layout.norm_names()):
        return "unexpected decoder layer norms"
    return None


def _gated(mlp: nn.Module, layout: Layout) -> bool:
    return all(hasattr(mlp, n) for n in (*layout.gate_up, "down_proj", layout.act))


def merged_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of the module's linear map with its active LoRA merged (summed in float32, rounded
    once to the base dtype: equal to the unmerged map up to that rounding), or None when the module must
    be called as is. Returns the base tensors themselves (no copy) when no LoRA is active."""
    parts = linear_parts(module)
    if parts is None:
        return None
    base, factors = parts
    if not factors:
        return base.weight, base.bias
    # Sum in float32, round once to the base dtype; a new tensor, the base weight is only read.
    merged = base.weight.float()
    for A_RI, B_OR, scale in factors:
        merged = merged + (B_OR.float() @ A_RI.float()) * scale
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

    def __init__(self, modules: list[nn.Module], state: PolicyState, dtype: torch.dtype, packs: PackCache | None):
        bases = [m.get_base_layer() if hasattr(m, "lora_A") else m for m in modules]
        packed = PackedLinear.of(bases, packs) if packs is not None else None
        self.base = packed or FusedLinear(bases, merge=True, dtype=dtype)
        if isinstance(self.base, FusedLinear) and self.base.modules is not None:
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


class Split:
    """The parts a layer takes from one input (q, k, v or gate, up): one output per module, or one fused
    module's output (Phi-3's qkv_proj, gate_up_proj) split by sizes. A LoRA on a fused module covers its
    whole output, so it is merged (or called) as one module and split afterwards."""

    def __init__(self, linear: FusedLinear | PackedLinear | PolicyFusedLinear, sizes: list[int]):
        self.linear, self.sizes = linear, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = self.linear(x)
        return outs if len(outs) == len(self.sizes) else outs[0].split(self.sizes, dim=-1)


class GatedMLP:
    """down(act(gate) * up), the gated MLP of every dense family."""

    def __init__(self, gate_up: Split, down: FusedLinear | PackedLinear | PolicyFusedLinear, act_fn: nn.Module):
        self.gate_up, self.down, self.act_fn = gate_up, down, act_fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(self.act_fn(gate) * up)[0]


class BlockMLP:
    """A sparse mixture-of-experts block called whole, in its own dtype (the sampler's compute dtype outside it):
    its router picks each token's experts from that token alone, as in the trainer's forward. A decode step's [A, H]
    runs as [A, 1, H] (rows on dim 0, as the block is given them in the trainer).

    merge: peft's LoRA on the block's parameters (ParamWrapper: the fused experts, a router's weight) is summed into
    new tensors once here, as the linear maps are (merged_weight), and the block runs on them with those wrappers
    off. peft itself adds the delta of every expert's weights anew in each forward: 4.1x the time of a sampling call
    on a small Qwen3-MoE on a CPU (docs/benchmarks.md)."""

    def __init__(self, block: nn.Module, dtype: torch.dtype, merge: bool):
        self.block, self.dtype = block, dtype
        self.block_dtype = next(p.dtype for p in block.parameters() if p.dtype.is_floating_point)
        names = {id(module): name for name, module in block.named_modules()}
        wrappers = [m for m in block.modules() if isinstance(m, ParamWrapper)] if merge else []
        self.merged = {}  # the block's path of each adapted parameter -> the parameter with its LoRA summed in
        for wrapper in wrappers:
            param = wrapper.get_param()
            active = [] if wrapper.disable_adapters or wrapper.merged else [
                name for name in wrapper.active_adapters if name in wrapper.lora_A]
            if active:
                with torch.no_grad():  # summed in float32, rounded once to the parameter's dtype
                    delta = sum(wrapper.get_delta_weight(name).float() for name in active)
                    path = f"{names[id(wrapper.get_base_layer())]}.{wrapper.parameter_name}".lstrip(".")
                    self.merged[path] = (param.float() + delta).to(param.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x if x.dim() == 3 else x[:, None]).to(self.block_dtype)
        if self.merged:
            with policies_disabled(self.block):  # each wrapper runs its base module, which reads the merged tensors
                out = torch.func.functional_call(self.block, self.merged, (rows,))
        else:
            out = self.block(rows)
        return (out if x.dim() == 3 else out[:, 0]).to(self.dtype)


class HeadNorm:
    """A norm over each head's d values (Qwen3, Gemma 3 q_norm/k_norm) applied to a flat [..., heads * d]."""

    def __init__(self, norm: Cast, head_dim: int):
        self.norm, self.head_dim = norm, head_dim

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)


@dataclass
class LayerView:
    """One decoder layer as the layout program runs it (rollout/layouts.py); a norm that is None is absent."""

    qkv: Split
    o_proj: FusedLinear
    mlp: GatedMLP | BlockMLP
    scaling: float
    attn_in_norm: Cast | None = None
    attn_out_norm: Cast | None = None
    mlp_in_norm: Cast | None = None
    mlp_out_norm: Cast | None = None
    q_norm: Callable | None = None
    k_norm: Callable | None = None
    rope: str | None = "default"  # which cos/sin table rotates q and k (DecoderView.rope_tables); None: NoPE
    window: int | None = None  # a sliding-window layer's W: a token sees the keys fewer than W positions back

    def attention_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [.., H*d], k and v [.., K*d] of x, q/k normed where the family norms them (before the rotary)."""
        q, k, v = self.qkv(x if self.attn_in_norm is None else self.attn_in_norm(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def add_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention sublayer, given its attention output [.., H*d]."""
        out = self.o_proj(attended)[0]
        return x + (out if self.attn_out_norm is None else self.attn_out_norm(out))

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP sublayer."""
        out = self.mlp(x if self.mlp_in_norm is None else self.mlp_in_norm(x))
        return x + (out if self.mlp_out_norm is None else self.mlp_out_norm(out))

    def release(self) -> None:
        """Drop the fused (merged) weight copies: a streamed layer's view is done with (models/sharded_base.py)."""
        self.qkv = self.o_proj = self.mlp = None


def decode_layers(view: "DecoderView", x_AH: torch.Tensor, tables: dict, attend) -> torch.Tensor:
    """One new token per row through every layer -> logits [A, V]. tables: view.rope_tables of the rows'
    positions. attend(layer, index, q_AHd, k_AKd, v_AKd) stores the key/value and returns the attention
    output [A, H*d] (the eager and the static decode steps differ only there)."""
    A, H, K, d = x_AH.shape[0], view.num_heads, view.num_kv_heads, view.head_dim
    for i, layer in enumerate(view.layers):
        q, k, v = layer.attention_inputs(x_AH)
        q, k = view.rotate(layer, q.view(A, H, 1, d), k.view(A, K, 1, d), tables)
        x_AH = layer.add_attention(x_AH, attend(layer, i, q[:, :, 0], k[:, :, 0], v.view(A, K, d)))
        x_AH = layer.add_mlp(x_AH)
    return view.logits(x_AH)


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
    layout: Layout
    rope_keys: tuple[str, ...] = ("default",)  # the cos/sin tables some layer uses
    windows: tuple[int, ...] = ()  # the distinct sliding windows of the layers (each step builds one mask per window)
    final_softcap: float | None = None  # Gemma 3's optional final logit soft-capping
    # whether a CUDA graph may replay the steps: not with a mixture-of-experts block (transformers' eager expert loop
    # reads the router's choices on the host; whether its grouped kernels capture has not been tried on a GPU)
    graphable: bool = True

    def rope_tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin of the positions for each table a layer uses: one, or (Gemma 3) one per layer type, whose
        rotary embeddings differ (a local and a global theta)."""
        if self.layout.rope_by_layer_type:
            return {kind: self.rotary(x, position_ids, kind) for kind in self.rope_keys}
        return {key: self.rotary(x, position_ids) for key in self.rope_keys}

    def rotate(self, layer: LayerView, q: torch.Tensor, k: torch.Tensor, tables: dict):
        """q and k (heads on dim 1) with the layer's rotary embedding applied, as the family applies it."""
        if layer.rope is None:
            return q, k
        cos, sin = tables[layer.rope]
        return self.layout.rotate(q, k, cos, sin)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer on the final norm of x, soft-capped where the model caps its logits."""
        logits = self.lm_head(self.norm(x))[0]
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    @classmethod
    def of(cls, model: nn.Module, merge: bool, dtype: torch.dtype | None = None,
           packs: PackCache | None = None) -> "DecoderView":
        """dtype: the sampler's compute dtype (default: the model's). A lower one, e.g. bfloat16 for a
        float32 model, samples from merged weight copies in that dtype. packs (a CPU): the linear maps run from
        packed copies of the base weights (oneDNN's, or fbgemm's float16; kept in `packs` between calls), their
        LoRA unmerged beside them (rollout/packed.py); layers that cannot be packed run as with merge. A model with
        several policy adapters gets each row's own adapter (PolicyFusedLinear; merge does not apply)."""
        hf = causal_lm(model)
        config, inner = hf.config, hf.model
        layout = LAYOUTS[config.model_type]
        dtype = dtype or inner.embed_tokens.weight.dtype
        policies = policy_state(model)
        if packs is not None and inner.embed_tokens.weight.device.type != "cpu":
            raise ValueError(f"{packs.format.name} run on the CPU only")
        if packs is not None and sharded_base(model) is not None:
            raise ValueError(f"{packs.format.name} need a base that stays put (a sharded base is gathered anew "
                             "each pass: packing it every time would cost more than it saves)")
        if packs is not None and packs.format.dtype != dtype:
            raise ValueError(f"{packs.format.name} compute in {packs.format.dtype}, the sampler in {dtype}")
        H, K = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // H

        def fused(modules: list[nn.Module]):
            if policies is not None:
                return PolicyFusedLinear(modules, policies, dtype, packs)
            packed = PackedLinear.of(modules, packs) if packs is not None and merge else None
            return packed or FusedLinear(modules, merge, dtype)

        def norm(module: nn.Module, name: str | None) -> Cast | None:
            return None if name is None else Cast(getattr(module, name), dtype)

        windows = [reachable_window(config, w) for w in layout.windows(config)]  # a window never reached: no mask

        def mlp_view(mlp: nn.Module) -> GatedMLP | BlockMLP:
            if layout.moe and is_sparse_block(mlp):
                return BlockMLP(mlp, dtype, merge and policies is None)
            gate_up = fused([getattr(mlp, n) for n in layout.gate_up])
            return GatedMLP(Split(gate_up, [sum(gate_up.sizes) // 2] * 2), fused([mlp.down_proj]),
                            getattr(mlp, layout.act))

        def layer_view(layer: nn.Module) -> LayerView:
            attn = layer.self_attn
            q_norm = k_norm = None
            if layout.qk_norm is not None:
                q_norm, k_norm = Cast(attn.q_norm, dtype), Cast(attn.k_norm, dtype)
                if layout.qk_norm == "head":
                    q_norm, k_norm = HeadNorm(q_norm, head_dim), HeadNorm(k_norm, head_dim)
            rope = config.layer_types[attn.layer_idx] if layout.rope_by_layer_type else "default"
            return LayerView(
                qkv=Split(fused([getattr(attn, n) for n in layout.qkv]), [H * head_dim, K * head_dim, K * head_dim]),
                o_proj=fused([attn.o_proj]),
                mlp=mlp_view(layer.mlp),
                scaling=attn.scaling,
                attn_in_norm=norm(layer, layout.attn_in_norm), attn_out_norm=norm(layer, layout.attn_out_norm),
                mlp_in_norm=norm(layer, layout.mlp_in_norm), mlp_out_norm=norm(layer, layout.mlp_out_norm),
                q_norm=q_norm, k_norm=k_norm,
                rope=rope if getattr(attn, "use_rope", True) else None,  # SmolLM3's NoPE layers
                window=windows[attn.layer_idx],
            )

        sharded = sharded_base(model)
        if sharded is not None and sharded.streams:  # train.fsdp_gather=layer: built in each pass, layer by layer
            layers = StreamedLayers(sharded, layer_view)
        else:
            layers = [layer_view(layer) for layer in inner.layers]
        rope_keys = tuple(sorted(set(config.layer_types))) if layout.rope_by_layer_type else ("default",)
        return cls(
            embed=Cast(inner.embed_tokens, dtype), rotary=inner.rotary_emb, layers=layers, norm=Cast(inner.norm, dtype),
            lm_head=fused([hf.lm_head]), num_heads=H, num_kv_heads=K, head_dim=head_dim, dtype=dtype,
            device=inner.embed_tokens.weight.device, layout=layout, rope_keys=rope_keys,
            windows=tuple(sorted({w for w in windows if w is not None})),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            graphable=not (layout.moe and any(is_sparse_block(layer.mlp) for layer in inner.layers)),
        )
