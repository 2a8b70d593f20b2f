"""Log-probs of given tokens for `rlora serve`'s forward_backward and prompt log-probs, under the model as it is
switched now: the decoder's last hidden states and the output layer a chunk of positions at a time (when training,
checkpointed where models/logprobs.recomputes_logits says: on a GPU, or a CPU past its budget of kept logits), or the model's full logits for a family rlora's chunked path does not cover."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlora.models.loading import causal_lm
from rlora.models.logprobs import recomputes_logits, supports_chunked, token_logprobs
from rlora.tensors import position_ids_from_mask

HEAD_CHUNK = 256  # positions per output-layer chunk


def unrouted(lo: int, hi: int):
    """head_routed for a pass of one adapter: the output layer runs as it is."""
    return nullcontext()


def sequence_logprobs(model: nn.Module, ids_BT: torch.Tensor, mask_BT: torch.Tensor, targets_BT: torch.Tensor,
                      head_routed=unrouted) -> torch.Tensor:
    """log p(targets_BT[b, t] | ids_BT[b, :t + 1]), [B, T] float32 (0 on padding), at temperature 1; for targets
    [B, T, K] (K targets at each position) [B, T, K]. Right padding; positions from the mask. head_routed(lo, hi):
    the context in which the output layer runs kept positions lo..hi (serve/batched.py routes each to its client's
    adapter); entered inside the checkpointed chunk, which backward runs again."""
    position_ids = position_ids_from_mask(mask_BT)
    keep_BT = mask_BT.bool()
    if not supports_chunked(model):
        logits = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids, use_cache=False).logits
        logp_BT = _targets_logprobs(logits, targets_BT)
        return logp_BT * (mask_BT if logp_BT.dim() == 2 else mask_BT[..., None])
    decoder = causal_lm(model).get_decoder()
    hidden_BTH = decoder(input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids,
                         use_cache=False).last_hidden_state
    logp_N = head_logprobs(model, hidden_BTH[keep_BT], targets_BT[keep_BT], head_routed)
    logp_BT = torch.zeros(targets_BT.shape, dtype=torch.float32, device=ids_BT.device)
    return logp_BT.index_put(keep_BT.nonzero(as_tuple=True), logp_N)


def head_logprobs(model: nn.Module, hidden_NH: torch.Tensor, targets_N: torch.Tensor, head_routed=unrouted
                  ) -> torch.Tensor:
    """The output layer over final hidden states, HEAD_CHUNK positions at a time (checkpointed where
    recomputes_logits says), -> log-probs of the targets ([N], or [N, K] for K targets a position)."""
    hf = causal_lm(model)
    head = hf.get_output_embeddings()

    def chunk_logp(h_CH, t_C, lo):
        with head_routed(lo, lo + len(t_C)):
            return _targets_logprobs(head(h_CH), t_C)

    recompute = (torch.is_grad_enabled() and hidden_NH.requires_grad
                 and recomputes_logits(len(targets_N), hf.config.get_text_config().vocab_size, hidden_NH.device))
    chunks = [(hidden_NH[lo:lo + HEAD_CHUNK], targets_N[lo:lo + HEAD_CHUNK], lo)
              for lo in range(0, len(targets_N), HEAD_CHUNK)]
    parts = [checkpoint(chunk_logp, *chunk, use_reentrant=False) if recompute else chunk_logp(*chunk)
             for chunk in chunks]
    return torch.cat(parts) if parts else torch.zeros(targets_N.shape, dtype=torch.float32, device=hidden_NH.device)


def _targets_logprobs(logits_NV: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probs of one target per position (targets [N]: models/logprobs.py token_logprobs, its lean backward) or
    of K per position (targets [N, K]: a gather and the logsumexp, through autograd)."""
    if targets.dim() == logits_NV.dim() - 1:
        return token_logprobs(logits_NV, targets, None, False)[0]
    logits_NV = logits_NV.float()
    return logits_NV.gather(-1, targets) - torch.logsumexp(logits_NV, dim=-1, keepdim=True)
