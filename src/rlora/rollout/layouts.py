"""Where each decoder family the built-in sampler runs keeps its parts, and what it computes unlike Llama.

The sampler (decoder.py, engine.py, graphed.py) runs one decoder-layer program for every family:

    h = attn_in_norm(x)                       (skipped where the family has none: OLMo 2/3)
    q, k, v = split(qkv(h))                   (separate q/k/v modules, or one fused module split by sizes)
    q, k = q_norm(q), k_norm(k)               (per head over d: Qwen3, Gemma 3; over all heads H*d: OLMo 2/3)
    q, k = rotate(q, k, cos, sin)             (the family's own rotary function; skipped on NoPE layers)
    a = o_proj(attention(q, k, v))
    x = x + attn_out_norm(a)                  (Gemma 3, OLMo 2/3 norm the attention output; others add it)
    m = down(act(gate) * up)   with gate, up = split(gate_up(mlp_in_norm(x)))
        or m = block(mlp_in_norm(x))          (a sparse mixture-of-experts layer: the model's own block)
    x = x + mlp_out_norm(m)                   (Gemma 3, OLMo 2/3)

A Layout names the modules that fill these roles in one family (None: the role is absent), so the program
has no per-family branches. Everything a family computes differently inside a module (Gemma 3's scaled
embeddings and (1 + weight) norms, OLMo 2's float32 rotary) is done by calling the model's own module or
function, so it is the Hugging Face computation by construction: a mixture-of-experts block (Mixtral, Qwen2/3-MoE,
OLMoE) is called whole, its router choosing each token's experts as in the trainer's forward. Each entry was read off transformers'
modeling_<family>.py (5.24); tests/test_engine_families.py compares every family with transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers.models.ernie4_5 import modeling_ernie4_5
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.glm4 import modeling_glm4
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmo2 import modeling_olmo2
from transformers.models.olmo3 import modeling_olmo3
from transformers.models.olmoe import modeling_olmoe
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe
from transformers.models.seed_oss import modeling_seed_oss
from transformers.models.smollm3 import modeling_smollm3

from rlora.models.loading import LENGTH_DEPENDENT_ROPE, rope_parameter_sets, rope_switch_length


def _no_window(config) -> list[int | None]:
    return [None] * config.num_hidden_layers


def _window_on_every_layer(config) -> list[int | None]:
    """Mistral, Phi-3, Mixtral, Qwen3-MoE: one sliding-window mask for all layers when the config sets a window."""
    return [config.sliding_window] * config.num_hidden_layers


def _window_by_layer_type(config) -> list[int | None]:
    """Qwen2/3, Qwen2-MoE, SmolLM3, Gemma 3, OLMo 3: the model builds a sliding-window mask for the 'sliding_attention' layers."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [config.sliding_window if kind == "sliding_attention" else None for kind in types[:config.num_hidden_layers]]


@dataclass(frozen=True)
class Layout:
    rotate: Callable  # the family's apply_rotary_pos_emb(q, k, cos, sin): partial rotary, float32 rotation
    windows: Callable  # config -> the sliding window of each layer (None: full attention)
    attn_in_norm: str | None = "input_layernorm"
    attn_out_norm: str | None = None
    mlp_in_norm: str | None = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one name: a fused module whose output is split
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # likewise
    act: str = "act_fn"
    qk_norm: str | None = None  # "head": q_norm/k_norm over each head's d values; "width": over all H*d
    rope_by_layer_type: bool = False  # rotary_emb(x, positions, layer_type): one table per layer type
    moe: bool = False  # a layer's mlp may be a sparse mixture-of-experts block (its `gate` router and `experts`)

    def norm_names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.attn_in_norm, self.attn_out_norm, self.mlp_in_norm, self.mlp_out_norm) if n)


# Llama, Qwen2 and Mistral keep Llama's rotary function, as the sampler always did (theirs is the same code).
_LLAMA = Layout(rotate=modeling_llama.apply_rotary_pos_emb, windows=_no_window)
# OLMo 2 and Gemma 3 norm each sublayer's output before the residual add; OLMo 2 has no input norms at all.
_NORMED_OUTPUTS = dict(attn_out_norm="post_attention_layernorm", mlp_out_norm="post_feedforward_layernorm")

LAYOUTS: dict[str, Layout] = {
    "llama": _LLAMA,
    "mistral": Layout(rotate=modeling_llama.apply_rotary_pos_emb, windows=_window_on_every_layer),
    "qwen2": Layout(rotate=modeling_llama.apply_rotary_pos_emb, windows=_window_by_layer_type),
    "qwen3": Layout(rotate=modeling_qwen3.apply_rotary_pos_emb, windows=_window_by_layer_type, qk_norm="head"),
    # NoPE layers: the attention module's use_rope flag (from config.no_rope_layers) is read per layer
    "smollm3": Layout(rotate=modeling_smollm3.apply_rotary_pos_emb, windows=_window_by_layer_type),
    "olmo2": Layout(rotate=modeling_olmo2.apply_rotary_pos_emb, windows=_no_window, attn_in_norm=None,
                    mlp_in_norm=None, qk_norm="width", **_NORMED_OUTPUTS),
    # OLMo 3: OLMo 2's layer with sliding-window layers (config.layer_types) and a rotary table per layer type
    "olmo3": Layout(rotate=modeling_olmo3.apply_rotary_pos_emb, windows=_window_by_layer_type, attn_in_norm=None,
                    mlp_in_norm=None, qk_norm="width", rope_by_layer_type=True, **_NORMED_OUTPUTS),
    # the scaled embedding, (1 + weight) norms and query_pre_attn_scalar (attn.scaling) come with the modules
    "gemma3_text": Layout(rotate=modeling_gemma3.apply_rotary_pos_emb, windows=_window_by_layer_type,
                          mlp_in_norm="pre_feedforward_layernorm", qk_norm="head", rope_by_layer_type=True,
                          **_NORMED_OUTPUTS),
    # fused qkv_proj ([q | k | v]) and gate_up_proj ([gate | up]); rotary on the first cos.shape[-1] dims
    "phi3": Layout(rotate=modeling_phi3.apply_rotary_pos_emb, windows=_window_on_every_layer, qkv=("qkv_proj",),
                   gate_up=("gate_up_proj",), act="activation_fn"),
    # GLM-4: four norms per layer (Gemma 3's places, its own names), fused gate_up_proj, interleaved partial rotary
    "glm4": Layout(rotate=modeling_glm4.apply_rotary_pos_emb, windows=_no_window,
                   attn_out_norm="post_self_attn_layernorm", mlp_out_norm="post_mlp_layernorm",
                   gate_up=("gate_up_proj",), act="activation_fn"),
    # ERNIE 4.5 (dense): Llama's layer with optional biases and an interleaved rotary
    "ernie4_5": Layout(rotate=modeling_ernie4_5.apply_rotary_pos_emb, windows=_no_window),
    # Seed-OSS: Llama's layer with q/k/v (and optionally output and MLP) biases
    "seed_oss": Layout(rotate=modeling_seed_oss.apply_rotary_pos_emb, windows=_no_window),
    # the mixtures of experts: a dense family's attention, and an MoE block in the layers their config makes sparse
    # (Qwen2/3-MoE's mlp_only_layers and decoder_sparse_step leave others dense: those run the gated program)
    "mixtral": Layout(rotate=modeling_mixtral.apply_rotary_pos_emb, windows=_window_on_every_layer, moe=True),
    "qwen2_moe": Layout(rotate=modeling_qwen2_moe.apply_rotary_pos_emb, windows=_window_by_layer_type, moe=True),
    "qwen3_moe": Layout(rotate=modeling_qwen3_moe.apply_rotary_pos_emb, windows=_window_on_every_layer, qk_norm="head",
                        moe=True),
    "olmoe": Layout(rotate=modeling_olmoe.apply_rotary_pos_emb, windows=_no_window, qk_norm="width", moe=True),
}

SUPPORTED_MODEL_TYPES = tuple(LAYOUTS)


def layout_refusal(model_type: str, config, max_length: int | None) -> str | None:
    """Why the sampler cannot run a model of this config for sequences up to max_length (None: it can)."""
    layout = LAYOUTS.get(model_type)
    if layout is None:
        return f"model type '{model_type}' (built-in sampler supports {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(config, "clip_qkv", None) is not None:  # OLMoE's option: the attention clamps q, k and v
        return "clip_qkv (clamped queries, keys and values)"
    # HF switches such frequencies in the middle of a generation, while the trainer's one forward uses one set
    limit = rope_switch_length(config)
    if limit is not None and (max_length is None or max_length > limit):
        kind = next(p["rope_type"] for p in rope_parameter_sets(config) if p.get("rope_type") in LENGTH_DEPENDENT_ROPE)
        return f"{kind} rotary embeddings beyond {limit} positions"
    return None
