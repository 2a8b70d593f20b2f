"""Mixture of LoRA experts (MoLoRA) on one frozen base: each adapted linear layer carries N LoRA experts and a
router that mixes them.

    out = base(x) + sum_e gate_e * (alpha / rank) * B_e @ A_e @ x

Expert weights are stored batched (A: [E, r, in], or one shared [r, in] with `hydra`; B: [E, out, r], zero at
start so a fresh MoLoRA equals the base exactly) and computed in one pass over all experts (two einsums; an
unselected expert has gate 0 and contributes exactly 0). Adapter weights and routers are float32.

Routers (one per adapted module, `nn.Linear(D, E, bias=False)` on an RMS-normalised input):
- "token": each token is routed from its own input x to that module (D = in_features).
- "sequence": each sequence is routed once from its prompt. The routing input is the prompt summary, the
  mean of the base's (frozen) input embeddings over the prompt tokens (D = hidden size). The caller sets it
  on the model (`sequence_routing(model, summary_BD)` / `routing_from_prompts(model, prompts)`) around
  every forward that belongs to those sequences: prefill and each decoding step when sampling, the one
  forward over prompt + completion when training. Every module reads the same summary, so the gates are the
  same in both paths whatever the module sees (the whole sequence or one new token with a KV cache).

Pure math (routing, the mixture, the auxiliary losses and metrics) is separate from the model plumbing
(attaching, the routing context, collecting losses, saving and loading). docs/molora.md has the formulas and
the saved format.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from rlora.config import MoLoRAConfig  # the settings: one definition, the YAML config's `molora:` section
from rlora.errors import UserError, first_line
from rlora.models.loading import read_format_file

FORMAT = "rlora-molora"
VERSION = 1
CONFIG_FILE = "molora_config.json"
WEIGHTS_FILE = "molora_model.safetensors"
RMS_EPS = 1e-6
PARAM_TAG = ".molora_"  # every MoLoRA parameter name contains it (molora_A, molora_B, molora_router.weight)


# ---- pure math -----------------------------------------------------------------------------------------

def rms_normalize(x_UD: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension (no weight): the router's input."""
    return x_UD * torch.rsqrt(x_UD.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def route(logits_UE: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(gates_UE, chosen_UK): softmax over experts, the top_k kept (renormalised to sum 1 when asked), the
    others 0. U: routing units (tokens or sequences)."""
    probs_UE = logits_UE.float().softmax(-1)
    kept_UK, chosen_UK = probs_UE.topk(top_k, dim=-1)
    if renormalize:
        kept_UK = kept_UK / kept_UK.sum(-1, keepdim=True)
    return torch.zeros_like(probs_UE).scatter(-1, chosen_UK, kept_UK), chosen_UK


def mixture_delta(x_XI: torch.Tensor, A: torch.Tensor, B_EOR: torch.Tensor, gates_XE: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """[X, O] = scale * sum_e gates[x, e] * B_e @ A_e @ x, all experts at once. A: [E, r, I] per expert or
    [r, I] shared (hydra)."""
    if A.dim() == 2:
        h_XER = (x_XI @ A.T)[:, None, :] * gates_XE[:, :, None]
    else:
        h_XER = torch.einsum("xi,eri->xer", x_XI, A) * gates_XE[:, :, None]
    return torch.einsum("xer,eor->xo", h_XER, B_EOR) * scale


def _unit_weights(count: int, mask_U: torch.Tensor | None, device) -> torch.Tensor:
    """[U] float weights of the routing units: 1 each, or the mask (0 = padding, excluded)."""
    if mask_U is None:
        return torch.ones(count, device=device)
    return mask_U.reshape(-1).to(device=device, dtype=torch.float32)


def _masked_mean(values_U: torch.Tensor, weights_U: torch.Tensor) -> torch.Tensor:
    return (values_U * weights_U).sum(0) / weights_U.sum().clamp_min(1.0)


def expert_utilisation(chosen_UK: torch.Tensor, num_experts: int, mask_U: torch.Tensor | None = None) -> torch.Tensor:
    """[E] f_e: the share of the (unmasked) routing assignments that go to expert e (sums to 1; each unit
    makes top_k assignments). No gradient."""
    weights_U = _unit_weights(chosen_UK.shape[0], mask_U, chosen_UK.device)
    hits_UE = F.one_hot(chosen_UK, num_experts).sum(1).float()
    return _masked_mean(hits_UE, weights_U[:, None]) / chosen_UK.shape[1]


def balance_loss(logits_UE: torch.Tensor, chosen_UK: torch.Tensor, mask_U: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load balancing, N * sum_e f_e * P_e: f_e = expert_utilisation (top-k assignments,
    no gradient), P_e = mean softmax probability of e; both over unmasked units. 1 when balanced."""
    num_experts = logits_UE.shape[-1]
    weights_U = _unit_weights(logits_UE.shape[0], mask_U, logits_UE.device)
    f_E = expert_utilisation(chosen_UK, num_experts, mask_U)
    P_E = _masked_mean(logits_UE.float().softmax(-1), weights_U[:, None])
    return num_experts * (f_E * P_E).sum()


def z_loss(logits_UE: torch.Tensor, mask_U: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss: mean over unmasked units of logsumexp(logits)^2."""
    weights_U = _unit_weights(logits_UE.shape[0], mask_U, logits_UE.device)
    return _masked_mean(torch.logsumexp(logits_UE.float(), -1).pow(2), weights_U)


def router_entropy(logits_UE: torch.Tensor, mask_U: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over unmasked units of the entropy (nats) of the full softmax over experts."""
    weights_U = _unit_weights(logits_UE.shape[0], mask_U, logits_UE.device)
    logp_UE = logits_UE.float().log_softmax(-1)
    return _masked_mean(-(logp_UE.exp() * logp_UE).sum(-1), weights_U)


# ---- the layer -----------------------------------------------------------------------------------------

@dataclass
class RoutingState:
    """Shared by every MoLoRALinear of one model: the config, the prompt summary of the sequences being run
    (sequence router) and the off switch (the base alone, e.g. the reference policy)."""
    config: MoLoRAConfig
    summary_BD: torch.Tensor | None = None
    disabled: bool = False


@dataclass
class RouterRecord:
    """A module's routing in its last forward. Units are tokens (token router: the flattened [B, T]) or
    sequences (sequence router: the B rows)."""
    logits_UE: torch.Tensor
    chosen_UK: torch.Tensor
    gates_UE: torch.Tensor
    per_token: bool


class MoLoRALinear(nn.Module):
    """A frozen nn.Linear plus N LoRA experts mixed by a router. Input [B, T, in] or [B, in] (B sequences of
    one token, e.g. a sampler's decoding step); the sequence router needs the state's summary for those B
    rows."""

    def __init__(self, base: nn.Linear, config: MoLoRAConfig, state: RoutingState | None = None,
                 summary_dim: int | None = None):
        super().__init__()
        self.base_layer = base
        self.state = state or RoutingState(config)
        self.in_features, self.out_features = base.in_features, base.out_features
        E, r, device = config.num_experts, config.rank, base.weight.device
        a_shape = (r, self.in_features) if config.hydra else (E, r, self.in_features)
        bound = 1.0 / math.sqrt(self.in_features)  # as peft's kaiming_uniform(a=sqrt(5)) on each A_e
        self.molora_A = nn.Parameter(torch.empty(a_shape, device=device).uniform_(-bound, bound))
        self.molora_B = nn.Parameter(torch.zeros(E, self.out_features, r, device=device))
        router_in = self.in_features if config.router == "token" else (summary_dim or self.in_features)
        self.molora_router = nn.Linear(router_in, E, bias=False, device=device, dtype=torch.float32)
        nn.init.normal_(self.molora_router.weight, 0.0, config.router_init_std)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.last: RouterRecord | None = None

    @property
    def config(self) -> MoLoRAConfig:
        return self.state.config

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def get_base_layer(self) -> nn.Linear:
        return self.base_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.state.disabled:
            return out
        dtype = self.molora_A.dtype  # float32 unless the caller cast the model
        x_XI = x.reshape(-1, self.in_features).to(dtype)
        gates_XE = self._gates(x, x_XI).to(dtype)
        delta_XO = mixture_delta(self.dropout(x_XI), self.molora_A, self.molora_B, gates_XE, self.config.scale)
        return out + delta_XO.view(out.shape).to(out.dtype)

    def _gates(self, x: torch.Tensor, x_XI: torch.Tensor) -> torch.Tensor:
        """[X, E] gates of the X tokens of x; records the routing of this forward."""
        per_token = self.config.router == "token"
        logits_UE = self.router_logits(x_XI if per_token else self._summary(x))
        gates_UE, chosen_UK = route(logits_UE, self.config.top_k, self.config.renormalize)
        self.last = RouterRecord(logits_UE, chosen_UK, gates_UE, per_token)
        if per_token:
            return gates_UE
        tokens_per_row = x_XI.shape[0] // x.shape[0]
        return gates_UE.repeat_interleave(tokens_per_row, dim=0)

    def router_logits(self, units_UD: torch.Tensor) -> torch.Tensor:
        """[U, E] router logits of U routing inputs (tokens' inputs, or prompt summaries)."""
        return self.molora_router(rms_normalize(units_UD.to(self.molora_router.weight.dtype)))

    def _summary(self, x: torch.Tensor) -> torch.Tensor:
        summary_BD = self.state.summary_BD
        if summary_BD is None:
            raise RuntimeError("MoLoRA sequence routing needs the prompts: run the model inside "
                               "`with sequence_routing(model, summary_BD)` (or routing_from_prompts)")
        if x.dim() not in (2, 3) or summary_BD.shape[0] != x.shape[0]:
            raise RuntimeError(f"MoLoRA sequence routing: input {tuple(x.shape)} has {x.shape[0]} rows, the "
                               f"routing summary {summary_BD.shape[0]} (expand it as the batch is expanded)")
        return summary_BD.to(device=x.device)

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"in={self.in_features}, out={self.out_features}, experts={cfg.num_experts}, rank={cfg.rank}, "
                f"router={cfg.router}, top_k={cfg.top_k}, hydra={cfg.hydra}")


# ---- model plumbing: attaching, routing context, losses ----------------------------------------------------

def _causal_lm(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def molora_modules(model: nn.Module) -> list[tuple[str, MoLoRALinear]]:
    """(name relative to the causal LM, module) of every MoLoRA layer, in module order."""
    return [(name, m) for name, m in _causal_lm(model).named_modules() if isinstance(m, MoLoRALinear)]


def routing_state(model: nn.Module) -> RoutingState:
    """The model's shared routing state (a MoLoRALinear on its own: its own)."""
    if isinstance(model, MoLoRALinear):
        return model.state
    modules = molora_modules(model)
    if not modules:
        raise RuntimeError("this model has no MoLoRA layers (attach_molora or load_molora first)")
    return modules[0][1].state


def prompt_summary(model: nn.Module, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B, D] float32: per prompt, the mean of the base's input embeddings of its tokens (no padding). Each
    row is computed from its own tokens alone, so the same prompt gives the same bits in any batch."""
    embed = _causal_lm(model).get_input_embeddings()
    device = embed.weight.device
    rows = []
    with torch.no_grad():
        for ids in prompts:
            if len(ids) == 0:
                raise ValueError("MoLoRA sequence routing: an empty prompt has no summary")
            rows.append(embed(torch.as_tensor(list(ids), dtype=torch.long, device=device)).float().mean(0))
    return torch.stack(rows)


def prompt_summary_padded(model: nn.Module, prompt_ids_BT: torch.Tensor, prompt_mask_BT: torch.Tensor) -> torch.Tensor:
    """prompt_summary of padded prompts (left or right padding; mask 1 = prompt token)."""
    keep_BT = prompt_mask_BT.bool()
    return prompt_summary(model, [ids[keep].tolist() for ids, keep in zip(prompt_ids_BT, keep_BT)])


def set_sequence_routing(model: nn.Module, summary_BD: torch.Tensor | None) -> None:
    """Route the next forwards' B rows by these prompt summaries (None: unset)."""
    routing_state(model).summary_BD = summary_BD


@contextmanager
def _state_set(model: nn.Module, field: str, value):
    """The model's routing state with `field` = value inside; the previous value is restored on exit."""
    state = routing_state(model)
    previous = getattr(state, field)
    setattr(state, field, value)
    try:
        yield value
    finally:
        setattr(state, field, previous)


@contextmanager
def sequence_routing(model: nn.Module, summary_BD: torch.Tensor):
    """Forwards inside route row b by summary_BD[b]; the previous setting is restored on exit."""
    with _state_set(model, "summary_BD", summary_BD):
        yield summary_BD


@contextmanager
def routing_from_prompts(model: nn.Module, prompts: Sequence[Sequence[int]]):
    """sequence_routing with prompt_summary(model, prompts)."""
    with sequence_routing(model, prompt_summary(model, prompts)) as summary_BD:
        yield summary_BD


@contextmanager
def molora_disabled(model: nn.Module):
    """The base alone (every expert off), e.g. the reference policy."""
    with _state_set(model, "disabled", True):
        yield model


def target_names(model: nn.Module, targets: str | list[str]) -> list[str]:
    """Names of the linear layers inside decoder layers that `targets` selects."""
    linears = [name for name, m in _causal_lm(model).named_modules() if isinstance(m, nn.Linear) and ".layers." in name]
    if targets == "all-linear":
        chosen = linears
    else:
        chosen = [name for name in linears if name.rsplit(".", 1)[-1] in targets]
        missing = sorted(set(targets) - {name.rsplit(".", 1)[-1] for name in chosen})
        if missing:
            available = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise UserError(f"MoLoRA target_modules {missing} match no linear layer in the decoder layers "
                            f"(available: {', '.join(available)})")
    if not chosen:
        raise UserError("MoLoRA target_modules select no linear layer inside the decoder layers")
    return chosen


def _check_bare(model: nn.Module) -> None:
    if hasattr(model, "peft_config"):
        raise UserError("MoLoRA attaches to the bare base model, not to one that already carries a peft adapter")
    if molora_modules(model):
        raise UserError("this model already carries MoLoRA layers")


def _check_attachable(model: nn.Module, names: list[str]) -> None:
    _check_bare(model)
    lm = _causal_lm(model)
    for name in names:
        module = lm.get_submodule(name)
        if type(module) is not nn.Linear or not module.weight.dtype.is_floating_point:
            raise UserError(f"MoLoRA cannot wrap '{name}' ({type(module).__name__}): quantized bases are not "
                            "supported yet")


def _attach(model: nn.Module, config: MoLoRAConfig, names: list[str]) -> list[nn.Parameter]:
    _check_attachable(model, names)
    lm = _causal_lm(model)
    lm.requires_grad_(False)
    state = RoutingState(config)
    summary_dim = lm.get_input_embeddings().embedding_dim
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = lm.get_submodule(parent_name)
        setattr(parent, child, MoLoRALinear(getattr(parent, child), config, state, summary_dim))
    return [p for n, p in lm.named_parameters() if PARAM_TAG in n]


def attach_molora(model: nn.Module, config: MoLoRAConfig) -> list[nn.Parameter]:
    """Replace the target linear layers of a Hugging Face causal LM (in place) by MoLoRALinear, freeze
    everything else; returns the trainable parameters (experts and routers)."""
    _check_bare(model)
    return _attach(model, config, target_names(model, config.target_modules))


@dataclass
class AuxLosses:
    balance: torch.Tensor  # sum over MoLoRA modules of balance_loss
    z: torch.Tensor  # sum over MoLoRA modules of z_loss
    total: torch.Tensor  # balance_coef * balance + z_coef * z
    modules: int


def _records(model: nn.Module) -> list[RouterRecord]:
    records = [m.last for _, m in molora_modules(model)]
    if not records or any(r is None for r in records):
        raise RuntimeError("no MoLoRA routing recorded: run a forward pass first")
    return records


def _unit_mask(record: RouterRecord, attention_mask_BT: torch.Tensor | None) -> torch.Tensor | None:
    """The token mask for a token router's units (None for a sequence router: every row counts)."""
    if attention_mask_BT is None or not record.per_token:
        return None
    if attention_mask_BT.numel() != record.logits_UE.shape[0]:
        raise RuntimeError(f"attention mask {tuple(attention_mask_BT.shape)} does not match the last forward's "
                           f"{record.logits_UE.shape[0]} tokens")
    return attention_mask_BT.reshape(-1)


def collect_aux_losses(model: nn.Module, attention_mask_BT: torch.Tensor | None = None) -> AuxLosses:
    """The auxiliary losses of the last forward, summed over all MoLoRA modules; padding tokens (mask 0)
    are excluded for token routers. Differentiable (call before the next forward)."""
    config = routing_state(model).config
    records = _records(model)
    balance = sum(balance_loss(r.logits_UE, r.chosen_UK, _unit_mask(r, attention_mask_BT)) for r in records)
    z = sum(z_loss(r.logits_UE, _unit_mask(r, attention_mask_BT)) for r in records)
    return AuxLosses(balance, z, config.balance_coef * balance + config.z_coef * z, len(records))


def router_metrics(model: nn.Module, attention_mask_BT: torch.Tensor | None = None) -> dict[str, float]:
    """Per-module means over the last forward: molora/balance (1 = balanced), molora/z_loss,
    molora/entropy (nats) and molora/util_<e> (share of assignments to expert e)."""
    config = routing_state(model).config
    records = _records(model)
    with torch.no_grad():
        masks = [_unit_mask(r, attention_mask_BT) for r in records]
        util_E = torch.stack([expert_utilisation(r.chosen_UK, config.num_experts, m) for r, m in zip(records, masks)])
        metrics = {
            "molora/balance": torch.stack([balance_loss(r.logits_UE, r.chosen_UK, m) for r, m in zip(records, masks)]),
            "molora/z_loss": torch.stack([z_loss(r.logits_UE, m) for r, m in zip(records, masks)]),
            "molora/entropy": torch.stack([router_entropy(r.logits_UE, m) for r, m in zip(records, masks)]),
        }
        values = {key: float(v.mean()) for key, v in metrics.items()}
        values.update({f"molora/util_{e}": float(u) for e, u in enumerate(util_E.mean(0))})
    return values


# ---- a batch of several forwards (micro-batches): statistics and the batch's auxiliary losses --------------

class RouterStats:
    """Per-module sums over the routing units of one or several forwards (the micro-batches of one batch):
    top-k assignments per expert, softmax probabilities, logsumexp^2, entropy, and the unit count (the same for
    every module). `metrics()` equals `router_metrics` of the whole batch in one forward, and `utilisation()`
    its f_e, whatever the micro-batching."""

    def __init__(self, num_experts: int, top_k: int):
        self.num_experts, self.top_k = num_experts, top_k
        self.hits_ME: torch.Tensor | None = None
        self.probs_ME: torch.Tensor | None = None
        self.z_M: torch.Tensor | None = None
        self.entropy_M: torch.Tensor | None = None
        self.units = 0.0

    @classmethod
    def for_model(cls, model: nn.Module) -> "RouterStats":
        config = routing_state(model).config
        return cls(config.num_experts, config.top_k)

    @torch.no_grad()
    def add(self, units: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> None:
        """Add one forward: per module (logits_UE, chosen_UK, mask_U or None)."""
        sums, count = [], None
        for logits_UE, chosen_UK, mask_U in units:
            w_U = _unit_weights(logits_UE.shape[0], mask_U, logits_UE.device)
            count = float(w_U.sum()) if count is None else count  # every module sees the same units
            logp_UE = logits_UE.float().log_softmax(-1)
            sums.append((
                (F.one_hot(chosen_UK, self.num_experts).sum(1).float() * w_U[:, None]).sum(0),
                (logp_UE.exp() * w_U[:, None]).sum(0),
                (torch.logsumexp(logits_UE.float(), -1).pow(2) * w_U).sum(),
                (-(logp_UE.exp() * logp_UE).sum(-1) * w_U).sum(),
            ))
        hits, probs, z, entropy = (torch.stack(column) for column in zip(*sums))
        if self.hits_ME is None:
            self.hits_ME, self.probs_ME, self.z_M, self.entropy_M = hits, probs, z, entropy
        else:
            self.hits_ME += hits
            self.probs_ME += probs
            self.z_M += z
            self.entropy_M += entropy
        self.units += count

    def add_forward(self, model: nn.Module, attention_mask_BT: torch.Tensor | None = None) -> None:
        """Add the model's last forward (padding excluded for token routers, as in collect_aux_losses)."""
        self.add([(r.logits_UE, r.chosen_UK, _unit_mask(r, attention_mask_BT)) for r in _records(model)])

    def add_summaries(self, model: nn.Module, summary_BD: torch.Tensor) -> None:
        """Add the routing that sequence routers give these prompt summaries, without running the model (their
        gates depend on the summary alone)."""
        modules = molora_modules(model)
        if modules[0][1].config.router != "sequence":
            raise RuntimeError("add_summaries needs sequence routers; a token router's routing needs a forward")
        with torch.no_grad():
            units = []
            for _, module in modules:
                logits_UE = module.router_logits(summary_BD.to(module.molora_router.weight.device))
                units.append((logits_UE, route(logits_UE, self.top_k)[1], None))
        self.add(units)

    def summed(self, sum_over_ranks, num_modules: int) -> "RouterStats":
        """The sums of every data-parallel rank (sum_over_ranks: a flat tensor -> its sum over ranks, a
        collective); a rank that routed nothing adds zeros."""
        M, E = num_modules, self.num_experts
        if self.hits_ME is None:
            parts = [torch.zeros(M, E), torch.zeros(M, E), torch.zeros(M), torch.zeros(M)]
        else:
            parts = [self.hits_ME, self.probs_ME, self.z_M, self.entropy_M]
        flat = torch.cat([p.float().cpu().reshape(-1) for p in parts] + [torch.tensor([float(self.units)])])
        total = sum_over_ranks(flat).cpu()
        out = RouterStats(self.num_experts, self.top_k)
        hits, probs, z, entropy, units = total.split([M * E, M * E, M, M, 1])
        out.hits_ME, out.probs_ME, out.z_M, out.entropy_M = hits.view(M, E), probs.view(M, E), z, entropy
        out.units = float(units)
        return out

    def utilisation(self) -> torch.Tensor:
        """[M, E] f_e of every module over all the units added (no gradient)."""
        if self.hits_ME is None:
            raise RuntimeError("RouterStats: nothing added yet")
        return self.hits_ME / (self.top_k * max(self.units, 1.0))

    def metrics(self) -> dict[str, float]:
        """router_metrics over all the units added: per-module means of balance, z-loss, entropy, utilisation."""
        units = max(self.units, 1.0)
        f_ME = self.utilisation()
        values = {
            "molora/balance": float((self.num_experts * (f_ME * self.probs_ME / units).sum(-1)).mean()),
            "molora/z_loss": float((self.z_M / units).mean()),
            "molora/entropy": float((self.entropy_M / units).mean()),
        }
        values.update({f"molora/util_{e}": float(u) for e, u in enumerate(f_ME.mean(0))})
        return values


def batch_aux_losses(model: nn.Module, utilisation_ME: torch.Tensor, batch_units: float,
                     attention_mask_BT: torch.Tensor | None = None) -> AuxLosses:
    """The last forward's share of a batch's auxiliary losses, where the batch runs as several forwards
    (micro-batches). With f_e the whole batch's utilisation (RouterStats.utilisation, from a pass over the
    batch) and W its unit count (rows for sequence routers, unpadded tokens for token routers):

        balance share = sum_modules N * sum_e f_e * sum_{u in this forward} w_u p_u[e] / W
        z share       = sum_modules sum_{u in this forward} w_u logsumexp(logits_u)^2 / W

    Summed over the batch's forwards these are collect_aux_losses of the whole batch in one forward (value and
    gradient), so how the batch is split does not change them."""
    config = routing_state(model).config
    records = _records(model)
    if utilisation_ME.shape != (len(records), config.num_experts):
        raise RuntimeError(f"utilisation {tuple(utilisation_ME.shape)} does not match {len(records)} modules x "
                           f"{config.num_experts} experts")
    balance = z = 0.0
    for record, f_E in zip(records, utilisation_ME):
        logits_UE = record.logits_UE.to(torch.promote_types(record.logits_UE.dtype, torch.float32))  # >= float32
        w_U = _unit_weights(logits_UE.shape[0], _unit_mask(record, attention_mask_BT), logits_UE.device)
        P_sum_E = (logits_UE.softmax(-1) * w_U[:, None]).sum(0)
        balance = balance + config.num_experts * (f_E.to(P_sum_E.device) * P_sum_E).sum() / batch_units
        z = z + (torch.logsumexp(logits_UE, -1).pow(2) * w_U).sum() / batch_units
    return AuxLosses(balance, z, config.balance_coef * balance + config.z_coef * z, len(records))


# ---- saving and loading ------------------------------------------------------------------------------------

def _router_input(config: MoLoRAConfig) -> str:
    return ("rms-normalised input of the module, per token" if config.router == "token"
            else "rms-normalised mean input embedding of the prompt tokens, per sequence")


def save_molora(model: nn.Module, folder: Path | str) -> None:
    """Write molora_config.json and molora_model.safetensors into `folder` (created if missing; the caller
    makes it atomic). Tensor names are the parameter names relative to the causal LM."""
    from safetensors.torch import save_file

    config = routing_state(model).config
    lm = _causal_lm(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().float().cpu().contiguous() for n, p in lm.named_parameters() if PARAM_TAG in n}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {
        "format": FORMAT, "version": VERSION, "config": config.model_dump(),
        "base_model": getattr(lm.config, "_name_or_path", None), "model_type": lm.config.model_type,
        "hidden_size": lm.get_input_embeddings().embedding_dim, "router_input": _router_input(config),
        "modules": [name for name, _ in molora_modules(model)],
        "weights": {"file": WEIGHTS_FILE, "dtype": "float32",
                    "tensors": "<module>.molora_A [E, r, in] ([r, in] with hydra), <module>.molora_B [E, out, r], "
                               "<module>.molora_router.weight [E, in] (token) or [E, hidden_size] (sequence)"},
    }
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_molora_meta(folder: str | Path) -> tuple[dict, MoLoRAConfig]:
    """(molora_config.json, its config) of a MoLoRA folder, checked: a one-line UserError when it is not one."""
    path = Path(folder)
    meta_path, meta = read_format_file(folder, CONFIG_FILE, FORMAT, "MoLoRA adapter")
    if meta.get("version") != VERSION:
        raise UserError(f"{meta_path}: unsupported version {meta.get('version')} (this rlora reads version {VERSION})")
    try:
        config = MoLoRAConfig.model_validate(meta.get("config"))
    except ValidationError as err:
        detail = err.errors()[0]
        raise UserError(f"{meta_path}: bad config ({'.'.join(map(str, detail['loc']))}: {detail['msg']})") from None
    modules = meta.get("modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise UserError(f"{meta_path}: 'modules' must be a non-empty list of module names")
    if not (path / WEIGHTS_FILE).is_file():
        raise UserError(f"MoLoRA folder '{folder}' has no {WEIGHTS_FILE}")
    return meta, config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 - truncated or not safetensors
        raise UserError(f"{path} is damaged (truncated or not safetensors): {first_line(err)}") from None


def expected_shapes(model: nn.Module, config: MoLoRAConfig, names: list[str]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} that MoLoRA on these modules of this (bare) model has."""
    lm = _causal_lm(model)
    E, r = config.num_experts, config.rank
    hidden = lm.get_input_embeddings().embedding_dim
    shapes = {}
    for name in names:
        try:
            module = lm.get_submodule(name)
        except AttributeError:
            raise UserError(f"MoLoRA module '{name}' does not exist in this model (built for another base?)") from None
        if not isinstance(module, nn.Linear):
            raise UserError(f"MoLoRA module '{name}' is a {type(module).__name__} in this model, not a linear layer")
        i, o = module.in_features, module.out_features
        shapes[f"{name}.molora_A"] = (r, i) if config.hydra else (E, r, i)
        shapes[f"{name}.molora_B"] = (E, o, r)
        shapes[f"{name}.molora_router.weight"] = (E, i if config.router == "token" else hidden)
    return shapes


def _check_tensors(folder, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise UserError(f"MoLoRA folder '{folder}': {WEIGHTS_FILE} lacks {len(missing)} and has {len(extra)} "
                        f"unexpected tensors (first: {(missing + extra)[0]})")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise UserError(f"MoLoRA folder '{folder}' does not fit this base model: {name} is "
                            f"{list(tensors[name].shape)}, this base needs {list(shape)}")


def load_molora(model: nn.Module, folder: str | Path, trainable: bool = False) -> list[nn.Parameter]:
    """Attach the MoLoRA saved in `folder` to a bare base (in place) with exactly its weights; returns its
    parameters (trainable: requires_grad on). Everything is checked before the model is changed."""
    meta, config = read_molora_meta(folder)
    _check_bare(model)
    hidden = _causal_lm(model).get_input_embeddings().embedding_dim
    if meta.get("hidden_size") != hidden:
        raise UserError(f"MoLoRA folder '{folder}' was built for a base with hidden size {meta.get('hidden_size')} "
                        f"({meta.get('base_model')}); this base has {hidden}: load it on its own base model")
    names = meta["modules"]
    tensors = _read_tensors(Path(folder) / WEIGHTS_FILE)
    _check_tensors(folder, tensors, expected_shapes(model, config, names))
    params = _attach(model, config, names)
    lm = _causal_lm(model)
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if PARAM_TAG in name:
                param.copy_(tensors[name])
                param.requires_grad_(trainable)
    return params
