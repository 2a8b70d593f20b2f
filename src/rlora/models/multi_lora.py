"""Several policy adapters on one base, served in one pass (batched multi-LoRA, as in Punica / S-LoRA).

K named peft LoRA adapters with one LoRA config sit on every adapted linear layer of one frozen base. In a
forward over N rows, row n goes through the adapter of policy policy_N[n]:

    y_n = W x_n + s_k * B_k A_k x_n,   k = policy_N[n]

The base matmul W x runs once over all rows. For the adapter part the rows are packed into a [K, M, ...]
layout (M: the most rows any policy has; the unused slots hold zeros) and each LoRA factor is one batched
matmul over the K adapters (torch.bmm), so the adapters cost one pass over the base weights and no loop over
adapters; the gradient of each adapter comes only from its own rows.

While a model carries several policies, every adapted layer computes the formula above and refuses to run
without knowing each row's policy (`policy_rows`): a forward that forgot it would otherwise silently run one
adapter for every row. With the adapters disabled (the reference policy) they run the base alone.
"""

from __future__ import annotations

import copy
import types
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora.layer import ParamWrapper
from safetensors.torch import save_file
from torch import nn

from rlora.config import LoraConfig
from rlora.errors import UserError, first_line
from rlora.models import block_routing, expert_lora
from rlora.models.loading import causal_lm, check_adapter_folder, peft_lora_config
from rlora.models.block_routing import token_slots
from rlora.models.sparse_blocks import check_layers_kept, in_sparse_block, sparse_block_names

STATE_ATTR = "_rlora_policies"
PEFT_NAME = "policy_{}"  # peft adapter name of a policy (peft mistakes short names such as 'a' for its 'lora_' prefix)


class RowBlocks:
    """Where each of N rows sits in the packed [K', M] layout: one block per policy that has rows (`present`, in
    policy order), its rows in their order at [block, 0..], M = the most rows any of them has. Rows already grouped
    in equal blocks (the usual micro-batch: rows come policy by policy) are packed by a view, without a copy."""

    def __init__(self, policy_N: torch.Tensor, num_policies: int):
        policy_N = policy_N.long()
        self.policy_N = policy_N  # each row's policy (a sparse block's tokens take their row's: block_routing)
        N = len(policy_N)
        counts_K = torch.bincount(policy_N, minlength=num_policies)
        present_P = (counts_K > 0).nonzero().squeeze(-1)
        self.present = present_P.tolist()
        self.present_P = present_P  # on the rows' device: select() copies nothing from the host (CUDA graphs)
        self.all_present = len(self.present) == num_policies
        self.N = N
        self.K, self.M = max(len(self.present), 1), max(int(counts_K.max()), 1) if N else 1
        block_of_policy = torch.zeros(num_policies, dtype=torch.long, device=policy_N.device)
        block_of_policy[self.present] = torch.arange(len(self.present), device=policy_N.device)
        block_N = block_of_policy[policy_N]
        grouped_N = torch.arange(N, device=policy_N.device) // self.M
        self.flat_N = None  # None: rows are in block order, M per block, so packing is a view
        if N != self.K * self.M or not torch.equal(block_N, grouped_N):
            order_N = torch.argsort(block_N, stable=True)
            starts = torch.cumsum(counts_K[self.present], 0) - counts_K[self.present]
            slot_N = torch.empty_like(policy_N)
            slot_N[order_N] = torch.arange(N, device=policy_N.device) - starts[block_N[order_N]]
            self.flat_N = block_N * self.M + slot_N  # index into the K' * M slots

    def pack(self, x_N: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [K', M, ...] (zeros where a policy has fewer than M rows); differentiable."""
        if x_N.shape[0] != self.N:  # e.g. a layer fed tokens, not rows: never route them by position
            raise RuntimeError(f"{x_N.shape[0]} inputs for {self.N} rows: policies route whole rows")
        if self.flat_N is None:
            return x_N.view(self.K, self.M, *x_N.shape[1:])
        packed = x_N.new_zeros((self.K * self.M, *x_N.shape[1:])).index_copy(0, self.flat_N.to(x_N.device), x_N)
        return packed.view(self.K, self.M, *x_N.shape[1:])

    def unpack(self, y_KM: torch.Tensor) -> torch.Tensor:
        """[K', M, ...] -> [N, ...] in the rows' order."""
        flat = y_KM.reshape(self.K * self.M, *y_KM.shape[2:])
        return flat if self.flat_N is None else flat[self.flat_N.to(y_KM.device)]

    def select(self, factor_K: torch.Tensor) -> torch.Tensor:
        """The present policies' entries of a per-policy tensor [K, ...] -> [K', ...]."""
        return factor_K if self.all_present else factor_K.index_select(0, self.present_P.to(factor_K.device))


def packed_lora_delta(x_KMI: torch.Tensor, A_KRI: torch.Tensor, B_KOR: torch.Tensor, scale_K: torch.Tensor,
                      ) -> torch.Tensor:
    """s_k * B_k A_k x for packed rows: x [K, M, ..., I] -> [K, M, ..., O], two batched matmuls (the scale is applied
    to the rank-R intermediate, the smallest tensor)."""
    K, M = x_KMI.shape[:2]
    x_KXI = x_KMI.reshape(K, -1, x_KMI.shape[-1])
    h_KXR = torch.bmm(x_KXI, A_KRI.transpose(1, 2)) * scale_K[:, None, None]
    y_KXO = torch.bmm(h_KXR, B_KOR.transpose(1, 2))
    return y_KXO.view(K, M, *x_KMI.shape[2:-1], B_KOR.shape[1])


def multi_lora_delta(x_NI: torch.Tensor, A_PRI: torch.Tensor, B_POR: torch.Tensor, scale_P: torch.Tensor,
                     blocks: RowBlocks) -> torch.Tensor:
    """The adapter part for rows of several policies: x [N, ..., I] -> [N, ..., O] (row n: its policy's adapter).
    A, B, scale: the factors of the policies present in the rows (blocks.present), in policy order."""
    return blocks.unpack(packed_lora_delta(blocks.pack(x_NI), A_PRI, B_POR, scale_P))


class PolicyState:
    """The policies of a model and the policy of each row of the forwards now running."""

    def __init__(self, names: list[str]):
        self.names = list(names)  # peft adapter names, in policy order
        self.blocks: RowBlocks | None = None

    def set_rows(self, policy_N: torch.Tensor | None) -> None:
        self.blocks = None if policy_N is None else RowBlocks(policy_N, len(self.names))


def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def stacked_factors(module: nn.Module, names: list[str], dtype: torch.dtype | None = None):
    """(A [K, R, I], B [K, O, R], scale [K]) of the named adapters of one layer (differentiable when dtype is
    None: torch.stack keeps each adapter's own parameters in the graph)."""
    A = torch.stack([module.lora_A[n].weight for n in names])
    B = torch.stack([module.lora_B[n].weight for n in names])
    scale = torch.tensor([float(module.scaling[n]) for n in names], device=A.device)
    if dtype is not None:
        A, B, scale = A.detach().to(dtype), B.detach().to(dtype), scale.to(dtype)
    return A, B, scale


def _policy_forward(module: nn.Module, state: PolicyState, in_block: bool):
    """A forward for one peft LoRA layer that sends each row through its policy's adapter (in_block: a layer inside
    a mixture's sparse block, fed the rows' tokens flattened [N * T, I]: routed as N rows of T)."""
    dropout = module.lora_dropout[state.names[0]]  # one LoRA config: the same dropout for every policy
    peft_forward = type(module).forward.__get__(module)
    policies = set(state.names)

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not policies.issuperset(module.active_adapters):  # another role's adapter is on (a reward adapter)
            return peft_forward(x, *args, **kwargs)
        result = module.base_layer(x, *args, **kwargs)
        if module.disable_adapters:
            return result
        if state.blocks is None:
            raise RuntimeError("a model with several policy adapters ran a forward without rows' policies "
                               "(wrap it in multi_lora.policy_rows)")
        blocks = state.blocks
        A, B, scale = stacked_factors(module, [state.names[k] for k in blocks.present])  # the present ones only
        x_in = dropout(x.to(A.dtype))
        rows = x_in if x_in.dim() > 1 else x_in[None]
        if in_block and rows.dim() == 2 and len(rows) != blocks.N:  # the block's tokens: N rows of T
            token_slots(blocks.policy_N, len(rows))  # refuses a count that is not N rows of T
            rows = rows.view(blocks.N, -1, rows.shape[-1])
        delta = multi_lora_delta(rows, A, B, scale, blocks)
        return result + delta.view(*result.shape[:-1], -1).to(result.dtype)

    return forward


def _policy_block_forward(module: ParamWrapper, state: PolicyState, experts: bool):
    """A forward for peft's LoRA on a router's weight or on the fused experts (their outermost wrapper) inside a
    sparse block: each token through its row's policy (models/block_routing.py)."""
    # the base, or another role's adapter (a critic, a reward adapter) alone: the experts as a run of one adapter
    # computes them (on the activations on a CPU), a router as peft does
    alone = types.MethodType(expert_lora.activation_side_forward, module) if experts else \
        type(module).forward.__get__(module)
    policies = set(state.names)

    def forward(x_SH: torch.Tensor, *args, **kwargs):
        if module.disable_adapters or not policies.issuperset(module.active_adapters):
            return alone(x_SH, *args, **kwargs)
        if state.blocks is None:
            raise RuntimeError("a model with several policy adapters ran a forward without rows' policies "
                               "(wrap it in multi_lora.policy_rows)")
        slot_S = token_slots(state.blocks.policy_N, len(x_SH)).to(x_SH.device)
        if experts:
            return block_routing.experts_forward(module, x_SH, *args, slot_S=slot_S, slots=state.names, **kwargs)
        return block_routing.router_forward(module, x_SH, slot_S, state.names, *args, **kwargs)

    return forward


def _whole_rows(state: PolicyState, adapted: list[nn.Module]):
    """A sparse block's pre-hook: while the policies' adapters in it (`adapted`) are on, the rows it is fed are the
    rows whose policies are set (inside, only tokens are seen: a wrong count of rows that happened to divide the
    tokens would route them by a guess). It reads a positional [N, T, H] input, as every family's decoder layer and
    the sampler's BlockMLP call the block; a call by keyword is not checked here (token_slots still needs whole rows)."""
    policies = set(state.names)

    def check(block: nn.Module, args) -> None:
        rows = args[0] if args else None
        if state.blocks is None or not isinstance(rows, torch.Tensor) or rows.dim() != 3:
            return
        if not any(not m.disable_adapters and policies.issuperset(m.active_adapters) for m in adapted):
            return
        if len(rows) != state.blocks.N:
            raise RuntimeError(f"{len(rows)} rows in a sparse block for {state.blocks.N} rows' policies: policies "
                               "route whole rows")

    return check


def policy_state(model: nn.Module) -> PolicyState | None:
    """The model's PolicyState, or None for a model with one policy."""
    return getattr(causal_lm(model), STATE_ATTR, None)


def attach_policies(base: nn.Module, cfg: LoraConfig, policies: list[str], seeds: list[int]):
    """K trainable LoRA adapters for the named policies on the frozen base (peft named adapters), each initialised
    with its seed (or each loaded from lora.init_from), and the batched forward installed on every adapted layer."""
    names = [PEFT_NAME.format(p) for p in policies]

    try:
        if cfg.init_from:
            check_adapter_folder(cfg.init_from)
            model = PeftModel.from_pretrained(base, cfg.init_from, adapter_name=names[0], is_trainable=True)
            for name in names[1:]:
                model.load_adapter(cfg.init_from, adapter_name=name, is_trainable=True)
        else:
            config = peft_lora_config(cfg, base)
            torch.manual_seed(seeds[0])
            model = get_peft_model(base, config, adapter_name=names[0])
            for name, seed in zip(names[1:], seeds[1:]):
                torch.manual_seed(seed)
                model.add_adapter(name, config)
    except (ValueError, RuntimeError, KeyError) as err:
        raise UserError(f"the policies' LoRA does not fit the model: {first_line(err)}") from None
    if not cfg.init_from:
        check_layers_kept(model, config.layers_to_transform)  # as one policy's attach_lora: no experts widening
    blocks = sparse_block_names(model)
    state = PolicyState(names)
    forwards = []  # (module, its forward)
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer")):
            continue
        if ".layers." not in name:  # e.g. lm_head: the log-prob passes feed it tokens, not rows
            raise UserError(f"policies: an adapter on '{name.rsplit('.', 1)[-1]}' (outside the decoder layers) is not "
                            "supported: target linear layers inside the decoder layers")
        block_name = in_sparse_block(name, blocks)
        block = None if block_name is None else model.get_submodule(block_name)
        if isinstance(module, ParamWrapper) and block is not None:  # a router's weight or the fused experts
            if not block_routing.token_routable(module, block):
                raise UserError(f"policies: peft's LoRA on '{name.split('.mlp.')[-1]}' (a mixture's experts of a "
                                "layout rlora does not route by row) is not supported: target the attention maps, "
                                "e.g. lora.target_modules=[q_proj, k_proj, v_proj, o_proj]")
            router = block_routing.is_router(module)
            if router or block_routing.is_experts(module, block):
                forwards.append((module, _policy_block_forward(module, state, experts=not router)))
            continue  # an inner experts wrapper: the outermost one computes every projection
        if type(module).__name__ != "Linear" or any(module.lora_variant.get(n) for n in names):
            raise UserError(f"policies: {type(module).__name__} LoRA layers (or DoRA) are not supported: "
                            "target linear layers with plain LoRA")
        forwards.append((module, _policy_forward(module, state, in_block=block is not None)))
    for module, forward in forwards:
        module.forward = forward
    for block_name in blocks:
        adapted = [module for module, _ in forwards if any(module is m for m in model.get_submodule(block_name).modules())]
        if adapted:
            model.get_submodule(block_name).register_forward_pre_hook(_whole_rows(state, adapted))
    setattr(causal_lm(model), STATE_ATTR, state)
    for name, param in model.named_parameters():
        param.requires_grad_(any(f".{n}." in name for n in names) and "lora_" in name)
    return model


@contextmanager
def policy_rows(model: nn.Module, policy_N: torch.Tensor | None):
    """The forwards inside send row n through policy policy_N[n] (a no-op for a model with one policy)."""
    state = policy_state(model)
    if state is None or policy_N is None:
        yield
        return
    previous = state.blocks
    state.set_rows(policy_N.to(next(model.parameters()).device))  # built once, where the layers run
    try:
        yield
    finally:
        state.blocks = previous


@contextmanager
def policies_disabled(model: nn.Module):
    """The base alone (the reference policy): every policy adapter off. peft's disable_adapter() would, on
    leaving, make only the active adapter trainable again; this keeps every policy's parameters as they were."""
    layers = lora_layers(model)
    before = [module._disable_adapters for module in layers]  # as they were: nested, the inner exit keeps them off
    for module in layers:
        module._disable_adapters = True
    try:
        yield model
    finally:
        for module, disabled in zip(layers, before):
            module._disable_adapters = disabled


def policy_parameters(model: nn.Module, policy: str) -> list[nn.Parameter]:
    """The parameters of one policy's adapter (all trainable: peft's adapter switching, which would freeze the
    inactive ones, is only ever used inside contexts that restore the flags)."""
    return _adapter_parameters(model, PEFT_NAME.format(policy))


def parameters_per_policy(model: nn.Module) -> list[list[nn.Parameter]]:
    """policy_parameters of every policy of the model, in policy order."""
    return [_adapter_parameters(model, name) for name in policy_state(model).names]


def _adapter_parameters(model: nn.Module, peft_name: str) -> list[nn.Parameter]:
    key = f".{peft_name}."
    params = [p for n, p in model.named_parameters() if key in n]
    if not params or not all(p.requires_grad for p in params):
        raise RuntimeError(f"policy adapter '{peft_name}': {'no' if not params else 'frozen'} parameters on the model")
    return params


def save_policy(model: nn.Module, policy: str, folder) -> None:
    """One policy's adapter as a plain PEFT folder (adapter_config.json + adapter_model.safetensors) that
    `PeftModel.from_pretrained(base, folder)` loads as its default adapter (peft's own save_pretrained would put a
    non-default adapter into a subfolder)."""
    name = PEFT_NAME.format(policy)
    Path(folder).mkdir(parents=True, exist_ok=True)
    weights = get_peft_model_state_dict(model, adapter_name=name)
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(Path(folder) / "adapter_model.safetensors"))
    config = copy.deepcopy(model.peft_config[name])
    config.base_model_name_or_path = getattr(causal_lm(model), "name_or_path", None) or config.base_model_name_or_path
    config.save_pretrained(str(folder))


class SamplerPolicies:
    """The policy of every row of a sampler that prefills P prompts, then decodes G rows per prompt (row b belongs
    to prompt b // G) whose active subset changes from step to step. A no-op for a model with one policy."""

    def __init__(self, model: nn.Module, policy_P: list[int] | None, G: int, device: torch.device):
        self.state, self.G = policy_state(model), G
        self.policy_P = None
        if self.state is None:
            if policy_P is not None and any(policy_P):
                raise ValueError("policies given for a model with one policy adapter")
            return
        if policy_P is None:
            raise ValueError("a model with several policy adapters samples with policies=[policy of each prompt]")
        self.policy_P = torch.tensor(policy_P, dtype=torch.long, device=device)

    @property
    def routes(self) -> bool:
        """Whether the rows' policies change what a forward computes (a model with several policies)."""
        return self.state is not None

    def prompts(self, index_n: list[int] | None = None) -> None:
        """The next forward runs these of the P prompts (prefill; None: all of them)."""
        if self.state is not None:
            self.state.set_rows(self.policy_P if index_n is None else self.policy_P[index_n])

    def rows(self, rows_A: torch.Tensor) -> None:
        """The next forwards run these rows of the P x G (a decoding step)."""
        if self.state is not None:
            self.state.set_rows(self.policy_P[rows_A.to(self.policy_P.device) // self.G])

    def __enter__(self) -> "SamplerPolicies":
        self.previous = None if self.state is None else self.state.blocks
        return self

    def __exit__(self, *exc) -> None:
        if self.state is not None:
            self.state.blocks = self.previous
