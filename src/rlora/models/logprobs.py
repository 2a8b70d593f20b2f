"""Log-probabilities and entropy of completion tokens under a model (adapter on or off).

Only the completion positions' logits are computed (`logits_to_keep`), and log-softmax is done as
`logit - logsumexp` in float32 rather than materialising a full log-softmax copy.
"""

from __future__ import annotations

import torch

from rlora.rollout.generator import position_ids_from_mask
from rlora.types import RolloutSlice


def completion_logprobs(
    model, batch: RolloutSlice, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (logp_BTc, entropy_BTc or None). Logits are divided by the sampling temperature, so the
    log-probs are those of the distribution the tokens were drawn from."""
    input_ids = torch.cat([batch.prompt_ids_BTp, batch.completion_ids_BTc], dim=1)
    attention_mask = torch.cat([batch.prompt_mask_BTp, batch.completion_mask_BTc], dim=1)
    num_completion = batch.completion_ids_BTc.shape[1]
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=num_completion + 1, use_cache=False,
    )
    logits_BTV = out.logits[:, :-1].float()  # position t predicts completion token t
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logsumexp_BT = torch.logsumexp(logits_BTV, dim=-1)
    token_logits_BT = logits_BTV.gather(-1, batch.completion_ids_BTc.unsqueeze(-1)).squeeze(-1)
    logp_BT = token_logits_BT - logsumexp_BT
    entropy_BT = None
    if with_entropy:
        with torch.no_grad():
            probs_BTV = torch.softmax(logits_BTV.detach(), dim=-1)
            entropy_BT = logsumexp_BT.detach() - (probs_BTV * logits_BTV.detach()).sum(-1)
    return logp_BT, entropy_BT
