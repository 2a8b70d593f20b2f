"""Log-probabilities and entropy of completion tokens under a model (adapter on or off).

Two paths give the same numbers:
- chunked (the families of CHUNKABLE_MODEL_TYPES): run the decoder to its last hidden states, keep only
  the positions that predict real completion tokens, and apply the output layer a chunk of positions at a
  time. With gradients on a GPU, or where the pass's logits would exceed KEEP_LOGITS_BYTES_CPU on a CPU, each chunk
  is checkpointed, so at most one chunk's [chunk, vocab] logits exist at once and the backward pass recomputes
  them; otherwise the chunks' logits are kept for the backward (recomputing them is one more output-layer product
  per token, ~10 % of an update's arithmetic on SmolLM2, and a CPU is short of arithmetic, not memory). The
  output layer is called as a module, so a tied or LoRA-carrying head works unchanged.
- full: the model's own forward with `logits_to_keep` (any architecture), materialising [B, Tc, vocab].
Log-softmax is `logit - logsumexp` in float32, logits divided by the temperature each token was sampled at
(the row's, or per token where the rollout carries temperature_BTc: phase-aware sampling). The [N, vocab] logits
are the largest tensors of a pass, and on a GPU each elementwise pass over them should cost about as much time as
the output layer's product (memory-bound; an estimate, not measured): the chunked path divides the float32 hidden states by the temperature before the output layer
([N, H] instead of [N, vocab]), and the target's log-prob has a backward of its own (`_TargetLogProb`: one softmax,
in place, where autograd's logsumexp and gather make and add two [N, vocab] tensors).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from rlora.models.frozen_prefix import PrefixSlice, suffix_hidden
from rlora.models.loading import causal_lm, model_device
from rlora.models.molora_runtime import prompt_routing
from rlora.models.packed_groups import packed_prompt_hidden, plan_packing
from rlora.models.shared_prompts import (
    prompt_cache_unsupported, prompt_groups, shared_prompt_hidden, sharing_prompts_unsupported,
)
from rlora.tensors import position_ids_from_mask
from rlora.types import RolloutSlice

# Families whose logits are exactly lm_head(final hidden state): no logit scale; Gemma 3 only without its
# optional final logit soft-capping (supports_chunked checks it).
CHUNKABLE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "olmo3", "smollm3",
                         "gemma3_text", "glm4", "ernie4_5", "seed_oss", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# The float32 logits a gradient pass on a CPU keeps for its backward rather than recomputing them (recomputes_logits)
KEEP_LOGITS_BYTES_CPU = 1 << 30


def supports_chunked(model) -> bool:
    config = causal_lm(model).config
    return config.model_type in CHUNKABLE_MODEL_TYPES and getattr(config, "final_logit_softcapping", None) is None


def completion_logprobs(
    model, batch: RolloutSlice, with_entropy: bool = False, chunk_tokens: int = 256, *, entropy_grad: bool = False,
    prefix: PrefixSlice | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (logp_BTc, entropy_BTc or None). chunk_tokens=0 forces the full-logits path. On the chunked
    path, positions outside the completion mask hold 0. The entropy carries no gradient unless
    entropy_grad=True (an entropy bonus in the loss); that costs its graph, so it is off by default.
    `prefix`: the batch's hidden states after the frozen lower layers, computed once per rollout
    (models/frozen_prefix.py); the decoder then starts above them (chunked path only). The results are on
    the model's device."""
    batch = batch.to(model_device(model))
    if prefix is not None and not (chunk_tokens and supports_chunked(model)):
        raise ValueError("a frozen prefix needs the chunked log-prob path (train.logprob_chunk_tokens > 0)")
    with prompt_routing(model, batch.prompt_ids_BTp, batch.prompt_mask_BTp):  # MoLoRA: routed by the prompts
        if chunk_tokens and supports_chunked(model):
            return _chunked_logprobs(model, batch, with_entropy, chunk_tokens, entropy_grad, prefix)
        return _full_logprobs(model, batch, with_entropy, entropy_grad)


def _inputs(batch: RolloutSlice) -> dict:
    input_ids = torch.cat([batch.prompt_ids_BTp, batch.completion_ids_BTc], dim=1)
    attention_mask = torch.cat([batch.prompt_mask_BTp, batch.completion_mask_BTc], dim=1)
    return dict(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False)


def token_temperatures(batch: RolloutSlice) -> torch.Tensor:
    """The temperature each completion token was drawn at, [B, Tc]. Padding gets the row's temperature,
    so that no logit is ever divided by the 0 a rollout may hold there."""
    B, Tc = batch.completion_ids_BTc.shape
    row_BT = batch.temperature_B[:, None].expand(B, Tc)
    if batch.temperature_BTc is None:
        return row_BT
    return torch.where(batch.completion_mask_BTc.bool(), batch.temperature_BTc[:, :Tc], row_BT)


def token_logprobs(logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature_N: torch.Tensor | None,
                   with_entropy: bool, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target under softmax(logits / temperature), and the entropy (with a gradient only
    if entropy_grad: the same numbers either way). temperature_N None: the logits are divided already."""
    scaled_NV = logits_NV.float()
    if temperature_N is not None:
        scaled_NV = scaled_NV / temperature_N[..., None]
    if with_entropy and entropy_grad:  # an entropy bonus: both through autograd's graph
        logsumexp_N = torch.logsumexp(scaled_NV, dim=-1)
        logp_N = scaled_NV.gather(-1, targets_N[..., None]).squeeze(-1) - logsumexp_N
        return logp_N, _entropy(scaled_NV, logsumexp_N)
    logp_N, logsumexp_N = _TargetLogProb.apply(scaled_NV, targets_N)
    entropy_N = None
    if with_entropy:
        with torch.no_grad():
            entropy_N = _entropy(scaled_NV, logsumexp_N)
    return logp_N, entropy_N


ENTROPY_ROWS = 16  # rows of the entropy's [rows, vocab] temporaries: a few MB, which stay in the CPU's cache


def _entropy(x_NV: torch.Tensor, logsumexp_N: torch.Tensor) -> torch.Tensor:
    """-sum p log p of each row of softmax(x_NV) (any leading dims), differentiable in x_NV. Not as logsumexp - sum
    p x: that difference of two numbers of the logits' size loses what float32 rounding of the softmax's normaliser
    leaves (1e-4 nats at logits near 25, 2e-4 on AVX2 kernels, against 5e-6 this way)."""
    rows_V = x_NV.reshape(-1, x_NV.shape[-1]) if x_NV.dim() == 2 or x_NV.is_contiguous() else None
    if rows_V is None:  # e.g. logits[:, :-1] of the full-logits path: one row of the leading dim at a time, no copy
        return torch.stack([_entropy(x, lse) for x, lse in zip(x_NV, logsumexp_N)]) if len(x_NV) else \
            torch.zeros_like(logsumexp_N)
    return _Entropy.apply(rows_V, logsumexp_N.detach().reshape(-1)).reshape(logsumexp_N.shape)


def _entropy_blocks(x_NV: torch.Tensor, logsumexp_N: torch.Tensor, grad_N: torch.Tensor | None = None,
                    entropy_N: torch.Tensor | None = None) -> torch.Tensor:
    """The entropy of each row from log p = x - logsumexp, ENTROPY_ROWS rows at a time (the temporaries stay in
    cache: 9 against 23 ms for 256 x 49152 on 2 cores); with grad_N (and the entropy), its gradient in x instead:
    -g p (log p + H), one [N, V] tensor. A product and a sum, not linalg.vecdot, which autocast would run in bfloat16."""
    out = torch.empty_like(x_NV) if grad_N is not None else torch.empty_like(logsumexp_N)
    for lo in range(0, len(x_NV), ENTROPY_ROWS):
        rows = slice(lo, lo + ENTROPY_ROWS)
        logp_RV = x_NV[rows] - logsumexp_N[rows, None]
        p_RV = logp_RV.exp()
        if grad_N is None:
            out[rows] = p_RV.mul_(logp_RV).sum(-1).neg_()
        else:
            out[rows] = logp_RV.add_(entropy_N[rows, None]).mul_(p_RV).mul_(-grad_N[rows, None])
    return out


class _Entropy(torch.autograd.Function):
    """The entropy of each row of x_NV [N, V] given its logsumexp; backward recomputes p from x (already kept for
    the log-probs' backward) instead of keeping [N, V] tensors of its own. d H / d x = -p (log p + H): the
    logsumexp's own dependence on x is inside that formula, so it gets no gradient. Differentiable once."""

    @staticmethod
    def forward(ctx, x_NV: torch.Tensor, logsumexp_N: torch.Tensor):
        entropy_N = _entropy_blocks(x_NV, logsumexp_N)
        ctx.save_for_backward(x_NV, logsumexp_N, entropy_N)
        return entropy_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_N: torch.Tensor):
        x_NV, logsumexp_N, entropy_N = ctx.saved_tensors
        return _entropy_blocks(x_NV, logsumexp_N, grad_N, entropy_N), None


class _TargetLogProb(torch.autograd.Function):
    """(x[target] - logsumexp(x), logsumexp(x)) per row of x_NV; the gradient flows through the first only:
    d/dx = g (onehot(target) - softmax(x)), made as one [N, V] tensor in place. The same float32 operations as
    autograd's (exp(x - lse) * -g, then + g at the target), so the same gradient, without its second [N, V]
    tensor (the gather's) and the sum of the two. Differentiable once (no create_graph through it: nothing in
    rlora takes second derivatives of log-probs)."""

    @staticmethod
    def forward(ctx, x_NV: torch.Tensor, targets_N: torch.Tensor):
        logsumexp_N = torch.logsumexp(x_NV, dim=-1)
        ctx.save_for_backward(x_NV, logsumexp_N, targets_N)
        ctx.mark_non_differentiable(logsumexp_N)
        return x_NV.gather(-1, targets_N[..., None]).squeeze(-1) - logsumexp_N, logsumexp_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_N: torch.Tensor, _grad_logsumexp: torch.Tensor | None):
        x_NV, logsumexp_N, targets_N = ctx.saved_tensors
        grad_NV = torch.sub(x_NV, logsumexp_N[..., None]).exp_().mul_(-grad_N[..., None])
        return grad_NV.scatter_add_(-1, targets_N[..., None], grad_N[..., None]), None


def _full_logprobs(model, batch: RolloutSlice, with_entropy: bool, entropy_grad: bool):
    num_completion = batch.completion_ids_BTc.shape[1]
    out = model(**_inputs(batch), logits_to_keep=num_completion + 1)
    logits_BTV = out.logits[:, :-1]  # position t predicts completion token t
    return token_logprobs(logits_BTV, batch.completion_ids_BTc, token_temperatures(batch), with_entropy, entropy_grad)


def completion_hidden(model, batch: RolloutSlice, prefix: PrefixSlice | None = None) -> torch.Tensor:
    """[B, Tc, H] final hidden states (after the last norm) at the positions that predict each completion token:
    position t holds the state before completion token t (what the output layer, or a value head, reads).
    `batch` must be on the model's device."""
    Tc = batch.completion_ids_BTc.shape[1]
    if prefix is None:
        groups = prompt_groups(batch) if sharing_prompts_unsupported(model) is None else None
        if groups is not None:  # rows that share a prompt: it runs once (models/shared_prompts.py)
            layout = plan_packing(model, batch, groups)  # with the rows' completions unpadded, where that is cheaper
            if layout is not None:
                return packed_prompt_hidden(model, batch, groups, layout)
            if prompt_cache_unsupported(model) is None:
                return shared_prompt_hidden(model, batch, groups)
        last_BTH = causal_lm(model).get_decoder()(**_inputs(batch)).last_hidden_state
    else:
        last_BTH = suffix_hidden(model, batch, prefix.hidden_BTH, prefix.num_frozen)
    return last_BTH[:, -(Tc + 1):-1]


def recomputes_logits(num_tokens: int, vocab: int, device: torch.device) -> bool:
    """Whether a gradient pass over num_tokens positions checkpoints its output-layer chunks (their logits recomputed
    in the backward) instead of keeping the float32 [num_tokens, vocab] logits: always on a GPU (as before; what a GPU
    run is short of is memory), on a CPU only past KEEP_LOGITS_BYTES_CPU."""
    return device.type != "cpu" or num_tokens * vocab * 4 > KEEP_LOGITS_BYTES_CPU


def _chunked_logprobs(model, batch: RolloutSlice, with_entropy: bool, chunk_tokens: int, entropy_grad: bool,
                      prefix: PrefixSlice | None):
    hf = causal_lm(model)
    B, Tc = batch.completion_ids_BTc.shape
    hidden_BTH = completion_hidden(model, batch, prefix)
    keep_BT = batch.completion_mask_BTc.bool()
    hidden_NH = hidden_BTH[keep_BT]
    targets_N = batch.completion_ids_BTc[keep_BT]
    temperature_N = token_temperatures(batch)[keep_BT]
    head = hf.get_output_embeddings()
    checkpointed = (torch.is_grad_enabled() and hidden_NH.requires_grad
                    and recomputes_logits(len(targets_N), hf.config.get_text_config().vocab_size, hidden_NH.device))
    chunks = [(hidden_NH[lo:lo + chunk_tokens], targets_N[lo:lo + chunk_tokens], temperature_N[lo:lo + chunk_tokens])
              for lo in range(0, len(targets_N), chunk_tokens)]
    if with_entropy and entropy_grad:
        logp_N, entropy_N = _chunks_with_entropy_grad(head, chunks, checkpointed)
        return _scatter(logp_N, keep_BT), _scatter(entropy_N, keep_BT)
    entropies, recording = [], [True]

    def chunk_logp(h_CH, targets_C, temperature_C):
        logits_CV, temperature_C = head_logits(head, h_CH, temperature_C)
        logp_C, entropy_C = token_logprobs(logits_CV, targets_C, temperature_C, with_entropy and recording[0])
        if entropy_C is not None:
            entropies.append(entropy_C)
        return logp_C

    parts = [checkpoint(chunk_logp, *args, use_reentrant=False) if checkpointed else chunk_logp(*args)
             for args in chunks]
    recording[0] = False  # the backward pass re-runs chunk_logp: no entropy there
    logp_BT = hidden_BTH.new_zeros(B, Tc, dtype=torch.float32)
    logp_BT = logp_BT.index_put((keep_BT.nonzero(as_tuple=True)), torch.cat(parts) if parts else logp_BT[keep_BT])
    entropy_BT = None
    if with_entropy:
        entropy_BT = hidden_BTH.new_zeros(B, Tc, dtype=torch.float32)
        entropy_BT[keep_BT] = torch.cat(entropies) if entropies else entropy_BT[keep_BT]
    return logp_BT, entropy_BT


def head_logits(head, h_CH: torch.Tensor, temperature_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (logits, the temperature still to divide them by, or None). An output layer none of whose modules adds a
    bias (its base layer, a LoRA's lora_B with peft's lora_bias, wrappers) is linear in its input, so logits / T =
    head(h / T): divided there, over H instead of vocab elements. Only float32 hidden states: a bfloat16 base's
    would round h / T once more (under autocast the head rounds h / T to bfloat16 where it would round h: the
    same size of error)."""
    if h_CH.dtype == torch.float32 and all(getattr(m, "bias", None) is None for m in head.modules()):
        return head(h_CH / temperature_C[:, None]), None
    return head(h_CH), temperature_C


def _chunks_with_entropy_grad(head, chunks, checkpointed: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Log-probs and entropies of all chunks, both with gradients: one checkpointed function returns the
    pair, so backward recomputes each chunk's logits once for both (no `recording` trick needed)."""
    def chunk_fn(h_CH, targets_C, temperature_C):
        logits_CV, temperature_C = head_logits(head, h_CH, temperature_C)
        return token_logprobs(logits_CV, targets_C, temperature_C, True, entropy_grad=True)

    outs = [checkpoint(chunk_fn, *args, use_reentrant=False) if checkpointed else chunk_fn(*args) for args in chunks]
    if not outs:  # no completion tokens at all
        return None, None
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _scatter(values_N: torch.Tensor | None, keep_BT: torch.Tensor) -> torch.Tensor:
    """Values of the kept positions -> [B, Tc] float32 with 0 elsewhere (differentiable)."""
    out_BT = torch.zeros(keep_BT.shape, dtype=torch.float32, device=keep_BT.device)
    return out_BT if values_N is None else out_BT.index_put(keep_BT.nonzero(as_tuple=True), values_N)
