"""The built-in losses of the tinker API, per token, on rlora's loss functions where they are the same.

Tinker's losses are sums over every token of every datum (tinker-docs.thinkingmachines.ai/tinker/losses),
with logp the training model's log-prob of target_tokens[i] and, for the RL losses, q the sampler's log-prob
(loss_fn_inputs['logprobs']) and A the advantage:

    cross_entropy        -sum(weights * logp); target_tokens and weights may be [n, K]: K targets at each position
    importance_sampling  -sum(exp(logp - q) * A)
    ppo                  -sum(min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)),  r = exp(logp - q)
                         (loss_fn_config thresholds; default 0.8 and 1.2)
    cispo                -sum(sg(clip(r, clip_low_threshold, clip_high_threshold)) * logp * A)   (the same thresholds)
    dro                  -sum(logp * A - beta / 2 * (logp - q)^2)   (loss_fn_config beta: required, Tinker documents
                         no default)
    gspo                 -sum(min(s_t * A, clip(s_t, clip_low_threshold, clip_high_threshold) * A)), GSPO-token:
                         s = exp(mean(logp - q)) over the tokens sequence_ratio_mask marks, one per datum; each token
                         carries s's value and its own log-prob's gradient, s_t = sg(s) * exp(logp - sg(logp))
                         (thresholds required: Tinker documents no default for gspo)

ppo and importance_sampling are rlora's PPO-clip surrogate (algos/losses.py grpo_token_loss), importance_sampling
with the clip range open on both sides; cispo is rlora's CISPO loss (cispo_token_loss). Any other loss name
(stable_reinforce) is refused when the request arrives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlora.algos.losses import LossInputs, cispo_token_loss, grpo_token_loss
from rlora.serve.state import ServeError


@dataclass(frozen=True)
class TokenLoss:
    inputs: tuple[str, ...]  # loss_fn_inputs it needs beside target_tokens
    optional: dict[str, float]  # inputs it may do without, and the value they take then
    config: dict[str, float | None]  # loss_fn_config keys it reads, and their defaults (None: the client must set it)
    fn: Callable[..., torch.Tensor]  # (logp_BT, mask_BT, inputs {name: [B, T]}, config) -> loss_BT

    def summed(self, logp_BT: torch.Tensor, mask_BT: torch.Tensor, inputs: dict[str, torch.Tensor],
               config: dict[str, float]) -> torch.Tensor:
        """The loss of these rows: its per-token values summed over the real positions (mask_BT 1)."""
        loss_BT = self.fn(logp_BT, mask_BT.float(), inputs, config)
        keep = mask_BT.bool() if loss_BT.dim() == 2 else mask_BT.bool()[..., None]  # [B, T, K]: K targets a token
        return torch.where(keep, loss_BT, torch.zeros_like(loss_BT)).sum()


def _cross_entropy(logp_BT, mask_BT, inputs, config) -> torch.Tensor:
    return -logp_BT * inputs["weights"]


def _rl_inputs(logp_BT, mask_BT, inputs) -> LossInputs:
    return LossInputs(logp_BT=logp_BT, old_logp_BT=inputs["logprobs"], advantages_BT=inputs["advantages"],
                      mask_BT=mask_BT)


def _ratio_loss(logp_BT, mask_BT, inputs, low: float, high: float) -> torch.Tensor:
    return grpo_token_loss(_rl_inputs(logp_BT, mask_BT, inputs), clip_low=low, clip_high=high, beta=0.0).loss_BT


def _importance_sampling(logp_BT, mask_BT, inputs, config) -> torch.Tensor:
    return _ratio_loss(logp_BT, mask_BT, inputs, math.inf, math.inf)


def _ppo(logp_BT, mask_BT, inputs, config) -> torch.Tensor:
    return _ratio_loss(logp_BT, mask_BT, inputs, 1.0 - config["clip_low_threshold"], config["clip_high_threshold"] - 1.0)


def _cispo(logp_BT, mask_BT, inputs, config) -> torch.Tensor:
    return cispo_token_loss(_rl_inputs(logp_BT, mask_BT, inputs), clip_low=1.0 - config["clip_low_threshold"],
                            clip_high=config["clip_high_threshold"] - 1.0, beta=0.0).loss_BT


def _dro(logp_BT, mask_BT, inputs, config) -> torch.Tensor:
    # the quadratic penalty keeps logp near the sampler's q without a ratio, so stale (off-policy) data stays usable
    return -(logp_BT * inputs["advantages"]) + 0.5 * config["beta"] * (logp_BT - inputs["logprobs"]) ** 2


def _gspo(logp_BT, mask_BT, inputs, config) -> torch.Tensor:
    in_ratio_BT = (inputs["sequence_ratio_mask"] != 0) & (mask_BT > 0)
    log_ratio_B = torch.where(in_ratio_BT, logp_BT.detach() - inputs["logprobs"], 0.0).sum(-1) \
        / in_ratio_BT.sum(-1).clamp(min=1)  # a datum without marked tokens is refused on arrival (check_datum)
    # the sequence ratio's value with each token's own gradient: d s_t = s * d logp_t
    ratio_BT = torch.exp(log_ratio_B[:, None] + logp_BT - logp_BT.detach())
    advantages_BT = inputs["advantages"]
    clipped_BT = torch.clamp(ratio_BT, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio_BT * advantages_BT, clipped_BT * advantages_BT)


_CLIPS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # Tinker's defaults for ppo and cispo

LOSSES = {
    "cross_entropy": TokenLoss((), {"weights": 1.0}, {}, _cross_entropy),
    "importance_sampling": TokenLoss(("logprobs", "advantages"), {}, {}, _importance_sampling),
    "ppo": TokenLoss(("logprobs", "advantages"), {}, _CLIPS, _ppo),
    "cispo": TokenLoss(("logprobs", "advantages"), {}, _CLIPS, _cispo),
    "dro": TokenLoss(("logprobs", "advantages"), {}, {"beta": None}, _dro),
    "gspo": TokenLoss(("logprobs", "advantages", "sequence_ratio_mask"), {},
                      {"clip_low_threshold": None, "clip_high_threshold": None}, _gspo),
}


def check_datum(name: str, index: int, inputs: dict) -> None:
    """What one datum's loss inputs must hold beyond their names (ServeError 400): K values per token ([n, K]) only
    in cross_entropy's target_tokens and weights, both of one shape (K targets at each position, each with its
    weight); gspo's sequence ratio needs at least one marked token (its mean over none is undefined)."""
    columns = sorted(key for key, values in inputs.items() if values.ndim == 2)
    if columns and (name != "cross_entropy" or set(columns) - {"target_tokens", "weights"}):
        raise ServeError(400, f"datum {index}: loss_fn_inputs {', '.join(columns)} hold K values per token; only "
                              "cross_entropy's target_tokens and weights may ([n, K]: K targets at each position)")
    if columns and (inputs["target_tokens"].ndim != 2
                    or ("weights" in inputs and inputs["weights"].shape != inputs["target_tokens"].shape)):
        raise ServeError(400, f"datum {index}: target_tokens {list(inputs['target_tokens'].shape)} and weights "
                              f"{list(inputs['weights'].shape) if 'weights' in inputs else None}: K targets per token need "
                              "weights of the same [n, K] shape (or none: weight 1 each)")
    if name == "gspo" and not (inputs["sequence_ratio_mask"] != 0).any():
        raise ServeError(400, f"datum {index}: loss_fn_inputs['sequence_ratio_mask'] marks no token: gspo's sequence "
                              "ratio is the mean over the marked (sampled) tokens")


def check_loss(name: str, input_names: set[str], config: dict[str, float | str],
               any_input_names: set[str] | None = None) -> dict[str, float]:
    """The loss's config with defaults filled in; a loss this server does not run, a missing input (input_names:
    what every datum has), an input it does not use (any_input_names: what some datum has), or an unknown or
    non-numeric config key -> ServeError 400."""
    loss = LOSSES.get(name)
    if loss is None:
        raise ServeError(400, f"loss_fn '{name}' is not served by rlora serve (served: {', '.join(LOSSES)}); "
                              "forward_backward_custom runs any loss in the client on top of cross_entropy")
    missing = [key for key in ("target_tokens", *loss.inputs) if key not in input_names]
    if missing:
        raise ServeError(400, f"loss_fn '{name}' needs loss_fn_inputs {', '.join(missing)}")
    takes = ("target_tokens", *loss.inputs, *loss.optional)
    extra = sorted((any_input_names or input_names) - set(takes))
    if extra:  # e.g. advantages sent with cross_entropy: the client meant another loss
        raise ServeError(400, f"loss_fn '{name}' does not use loss_fn_inputs {', '.join(extra)} (it takes: "
                              f"{', '.join(takes)})")
    unknown = sorted(set(config) - set(loss.config))
    if unknown:
        known = ", ".join(loss.config) or "none"
        raise ServeError(400, f"loss_fn '{name}': unknown loss_fn_config {', '.join(unknown)} (it takes: {known})")
    resolved = dict(loss.config)
    for key, value in config.items():
        if isinstance(value, str) or not math.isfinite(value):
            raise ServeError(400, f"loss_fn_config['{key}'] must be a finite number, not {value!r}")
        resolved[key] = float(value)
    unset = [key for key, value in resolved.items() if value is None]
    if unset:
        # gspo's ratio is a per-token geometric mean: its paper clips at 1 -/+ ~4e-4, not PPO's 0.2
        example = {"beta": 0.05, "clip_low_threshold": 0.9997 if name == "gspo" else 0.8,
                   "clip_high_threshold": 1.0004 if name == "gspo" else 1.2}
        raise ServeError(400, f"loss_fn '{name}' needs loss_fn_config {', '.join(unset)} (it has no default: e.g. "
                              f"loss_fn_config={{{', '.join(f'{k!r}: {example[k]}' for k in unset)}}})")
    if "clip_low_threshold" in resolved and not resolved["clip_low_threshold"] <= 1.0 <= resolved["clip_high_threshold"]:
        raise ServeError(400, f"{name}: loss_fn_config needs clip_low_threshold <= 1 <= clip_high_threshold")
    if resolved.get("beta", 0.0) < 0:
        raise ServeError(400, f"{name}: loss_fn_config beta must be >= 0, not {resolved['beta']}")
    return resolved
