"""MoLoRA (src/rlora/models/molora/): the layer against a naive per-expert loop, the auxiliary losses against
hand-computed values, exactness at start, per-sequence routing identical in incremental decoding and in one
full forward, and where gradients go. Saved folders: tests/test_molora_folder.py."""

import math

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from rlora.errors import UserError
from rlora.models import molora as ml
from rlora.models.molora import MoLoRAConfig, MoLoRALinear

# ---- helpers -------------------------------------------------------------------------------------------------


def load_base(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def randomise(model_or_layer, b_std: float = 0.05, router_std: float = 0.5, seed: int = 1) -> None:
    """Non-zero B and spread-out routers so every expert and the routing matter."""
    gen = torch.Generator().manual_seed(seed)
    single = isinstance(model_or_layer, MoLoRALinear)
    layers = [model_or_layer] if single else [m for _, m in ml.molora_modules(model_or_layer)]
    with torch.no_grad():
        for layer in layers:
            for param, std in ((layer.molora_B, b_std), (layer.molora_router.weight, router_std)):
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def naive_routing(layer: MoLoRALinear, unit: torch.Tensor) -> dict[int, float]:
    """{expert: gate} for one routing unit (a token's input or a prompt summary), one expert at a time."""
    cfg = layer.config
    u = unit.double()
    u = u / torch.sqrt((u * u).mean() + ml.RMS_EPS)
    logits = [float(layer.molora_router.weight[e].double() @ u) for e in range(cfg.num_experts)]
    top = max(logits)
    probs = [math.exp(v - top) for v in logits]
    probs = [p / sum(probs) for p in probs]
    order = sorted(range(cfg.num_experts), key=lambda e: -probs[e])[:cfg.top_k]
    total = sum(probs[e] for e in order) if cfg.renormalize else 1.0
    return {e: probs[e] / total for e in order}


def naive_forward(layer: MoLoRALinear, x_BTI: torch.Tensor, summary_BD=None):
    """(out_BTO, gates per (b, t)) with a Python loop over tokens and experts."""
    cfg = layer.config
    with torch.no_grad():
        return _naive_forward(layer, cfg, x_BTI, summary_BD)


def _naive_forward(layer, cfg, x_BTI, summary_BD):
    out = layer.base_layer(x_BTI).double().clone()
    gates = {}
    for b in range(x_BTI.shape[0]):
        for t in range(x_BTI.shape[1]):
            x = x_BTI[b, t].double()
            chosen = naive_routing(layer, x if cfg.router == "token" else summary_BD[b])
            gates[b, t] = chosen
            for e, gate in chosen.items():
                A_e = layer.molora_A if cfg.hydra else layer.molora_A[e]
                out[b, t] += gate * cfg.scale * (layer.molora_B[e].double() @ (A_e.double() @ x))
    return out, gates


def one_line(err) -> bool:
    return "\n" not in str(err.value)


def left_pad(prompts: list[list[int]], pad_id: int = 0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def positions(mask_BT: torch.Tensor) -> torch.Tensor:
    return (mask_BT.cumsum(-1) - 1).clamp_min(0)


PROMPTS = [[5, 17, 33, 41, 8, 99, 120], [64, 3, 250, 11]]


# ---- config ------------------------------------------------------------------------------------------------

def test_config_checks():
    assert MoLoRAConfig(target_modules="q_proj").target_modules == ["q_proj"]
    assert MoLoRAConfig().scale == 2.0
    with pytest.raises(ValidationError, match="top_k"):
        MoLoRAConfig(num_experts=2, top_k=3)
    with pytest.raises(ValidationError):
        MoLoRAConfig(router="layer")
    with pytest.raises(ValidationError):
        MoLoRAConfig(bogus=1)


# ---- the layer against a naive loop ------------------------------------------------------------------------

LAYER_CASES = [(router, k, hydra, True) for router in ("token", "sequence") for k in (1, 2) for hydra in (False, True)]
LAYER_CASES += [("token", 1, False, False), ("sequence", 2, True, False)]  # kept gates = raw probabilities


@pytest.mark.parametrize("router,top_k,hydra,renormalize", LAYER_CASES)
def test_layer_matches_naive_loop(router, top_k, hydra, renormalize):
    cfg = MoLoRAConfig(num_experts=3, rank=2, alpha=3.0, router=router, top_k=top_k, hydra=hydra,
                       renormalize=renormalize)
    layer = MoLoRALinear(nn.Linear(6, 5), cfg, summary_dim=7)
    randomise(layer, b_std=0.5, router_std=1.0)
    x_BTI = torch.randn(2, 4, 6)
    summary_BD = torch.randn(2, 7)
    with ml.sequence_routing(layer, summary_BD):
        out = layer(x_BTI)
    want, gates = naive_forward(layer, x_BTI, summary_BD)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)
    rec = layer.last
    assert rec.per_token == (router == "token")
    gates_UE = rec.gates_UE.view(2, 4, 3) if rec.per_token else rec.gates_UE[:, None].expand(2, 4, 3)
    for (b, t), chosen in gates.items():
        dense = [chosen.get(e, 0.0) for e in range(3)]
        torch.testing.assert_close(gates_UE[b, t].double(), torch.tensor(dense, dtype=torch.float64), atol=1e-6, rtol=0)
    assert all(len(chosen) == top_k for chosen in gates.values())


def test_sequence_router_one_token_rows_and_errors():
    layer = MoLoRALinear(nn.Linear(6, 5), MoLoRAConfig(num_experts=3, rank=2, router="sequence"), summary_dim=7)
    randomise(layer)
    x_BI = torch.randn(3, 6)
    with pytest.raises(RuntimeError, match="sequence_routing"):
        layer(x_BI)
    with ml.sequence_routing(layer, torch.randn(3, 7)):
        torch.testing.assert_close(layer(x_BI), layer(x_BI[:, None])[:, 0], atol=0, rtol=0)
        with pytest.raises(RuntimeError, match="rows"):
            layer(torch.randn(2, 6))
    assert layer.state.summary_BD is None  # the context restores the previous setting


@pytest.mark.parametrize("router", ["token", "sequence"])
def test_layer_runs_when_cast_to_bfloat16(router):
    layer = MoLoRALinear(nn.Linear(6, 5), MoLoRAConfig(num_experts=3, rank=2, router=router), summary_dim=7)
    randomise(layer)
    x = torch.randn(2, 3, 6)
    with ml.sequence_routing(layer, torch.randn(2, 7)):
        want = layer(x)
        got = layer.to(torch.bfloat16)(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


def test_unselected_experts_get_no_gradient():
    cfg = MoLoRAConfig(num_experts=4, rank=2, router="sequence", top_k=1)
    layer = MoLoRALinear(nn.Linear(6, 5), cfg, summary_dim=7)
    randomise(layer, router_std=1.0)
    with ml.sequence_routing(layer, torch.randn(1, 7)):
        layer(torch.randn(1, 3, 6)).sum().backward()
    chosen = int(layer.last.chosen_UK[0, 0])
    for e in range(4):
        used = e == chosen
        assert (layer.molora_B.grad[e].abs().sum() > 0) == used
        assert (layer.molora_A.grad[e].abs().sum() > 0) == used


# ---- auxiliary losses and metrics (hand-computed) ---------------------------------------------------------

def test_balance_loss_top1_with_padding():
    ln3 = math.log(3.0)
    logits = torch.tensor([[ln3, 0.0], [0.0, ln3], [ln3, 0.0], [5.0, 5.0]])
    chosen = torch.tensor([[0], [1], [0], [1]])
    mask = torch.tensor([1, 1, 1, 0])
    # f = (2/3, 1/3); P = ((.75 + .25 + .75) / 3, (.25 + .75 + .25) / 3); loss = 2 * (f . P) = 9.5 / 9
    assert ml.balance_loss(logits, chosen, mask).item() == pytest.approx(9.5 / 9, abs=1e-6)
    torch.testing.assert_close(ml.expert_utilisation(chosen, 2, mask), torch.tensor([2 / 3, 1 / 3]))
    # unmasked: f = (.5, .5), P = ((1.75 + .5) / 4, (1.25 + .5) / 4) -> 2 * .5 * 1 = 1
    assert ml.balance_loss(logits, chosen).item() == pytest.approx(1.0, abs=1e-6)


def test_balance_loss_top2_counts_assignments():
    chosen = torch.tensor([[0, 1], [0, 2]])
    torch.testing.assert_close(ml.expert_utilisation(chosen, 3), torch.tensor([0.5, 0.25, 0.25]))
    assert ml.balance_loss(torch.zeros(2, 3), chosen).item() == pytest.approx(1.0, abs=1e-6)
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]])  # p = (.5, .25, .25) and (1/3, 1/3, 1/3)
    # P = (5/12, 7/24, 7/24); 3 * (.5 * 5/12 + .25 * 7/24 + .25 * 7/24) = 51/48
    assert ml.balance_loss(logits, chosen).item() == pytest.approx(51 / 48, abs=1e-6)


def test_balance_loss_gradient_goes_through_probabilities_only():
    logits = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    ml.balance_loss(logits, logits.argmax(-1, keepdim=True)).backward()
    # f = (.5, .5) constant: loss = 2 * .5 * (P_0 + P_1) = 1 whatever the logits -> zero gradient
    torch.testing.assert_close(logits.grad, torch.zeros(2, 2))


def test_z_loss_and_entropy():
    ln3 = math.log(3.0)
    logits = torch.tensor([[ln3, 0.0], [0.0, ln3], [5.0, 5.0]])
    mask = torch.tensor([1, 1, 0])
    assert ml.z_loss(logits, mask).item() == pytest.approx(math.log(4.0) ** 2, abs=1e-6)
    want = (2 * math.log(4.0) ** 2 + (5 + math.log(2.0)) ** 2) / 3
    assert ml.z_loss(logits).item() == pytest.approx(want, abs=1e-5)
    entropy_34 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert ml.router_entropy(logits, mask).item() == pytest.approx(entropy_34, abs=1e-6)
    assert ml.router_entropy(logits).item() == pytest.approx((2 * entropy_34 + math.log(2.0)) / 3, abs=1e-6)


def test_route_renormalises_kept_gates():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    gates, chosen = ml.route(logits, 2)
    torch.testing.assert_close(gates, torch.tensor([[0.625, 0.375, 0.0]]))
    assert chosen.tolist() == [[0, 1]]
    gates, _ = ml.route(logits, 2, renormalize=False)
    torch.testing.assert_close(gates, torch.tensor([[0.5, 0.3, 0.0]]))


# ---- on a tiny Llama ---------------------------------------------------------------------------------------

def test_attach_targets(tiny_model_dir):
    model = load_base(tiny_model_dir)
    params = ml.attach_molora(model, MoLoRAConfig(num_experts=2, rank=2))
    names = [n for n, _ in ml.molora_modules(model)]
    assert len(names) == 2 * 7 and all(".layers." in n for n in names)
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, MoLoRALinear)
    assert len(params) == 3 * len(names)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
    with pytest.raises(UserError, match="already"):
        ml.attach_molora(model, MoLoRAConfig())
    model = load_base(tiny_model_dir)
    ml.attach_molora(model, MoLoRAConfig(target_modules=["q_proj", "v_proj"]))
    assert [n.rsplit(".", 1)[-1] for n, _ in ml.molora_modules(model)] == ["q_proj", "v_proj"] * 2
    with pytest.raises(UserError, match="qq_proj") as err:
        ml.attach_molora(load_base(tiny_model_dir), MoLoRAConfig(target_modules=["qq_proj"]))
    assert one_line(err)
    # another kind of linear layer (e.g. transformers' fp8 ones, subclasses of nn.Linear) is refused, not wrapped
    model = load_base(tiny_model_dir)
    attention = model.model.layers[0].self_attn
    attention.q_proj = type("Fp8LikeLinear", (nn.Linear,), {})(attention.q_proj.in_features, attention.q_proj.out_features)
    with pytest.raises(UserError, match="MoLoRA cannot wrap 'model.layers.0.self_attn.q_proj' .Fp8LikeLinear.") as err:
        ml.attach_molora(model, MoLoRAConfig(target_modules=["q_proj"]))
    assert one_line(err)


@pytest.mark.parametrize("router,hydra", [("token", False), ("sequence", True)])
def test_fresh_molora_equals_base_exactly(tiny_model_dir, router, hydra):
    ids, mask = left_pad(PROMPTS)
    base = load_base(tiny_model_dir)
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    ml.attach_molora(base, MoLoRAConfig(num_experts=3, rank=4, router=router, hydra=hydra, router_init_std=0.5))
    with torch.no_grad(), ml.routing_from_prompts(base, PROMPTS):
        got = base(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        randomise(base)
        changed = base(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        with ml.molora_disabled(base):
            off = base(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert torch.equal(got, want) and torch.equal(off, want)
    assert (changed - want).abs().max() > 1e-3  # the experts matter once B is non-zero


def test_prompt_summary_ignores_padding(tiny_model_dir):
    model = load_base(tiny_model_dir)
    summary = ml.prompt_summary(model, PROMPTS)
    ids, mask = left_pad(PROMPTS)
    assert torch.equal(ml.prompt_summary_padded(model, ids, mask), summary)
    right_ids = torch.tensor([PROMPTS[0], PROMPTS[1] + [0, 0, 0]])
    right_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    assert torch.equal(ml.prompt_summary_padded(model, right_ids, right_mask), summary)
    want = model.get_input_embeddings().weight[PROMPTS[1]].mean(0)
    torch.testing.assert_close(summary[1], want, atol=1e-7, rtol=0)


def _gates_by_module(model):
    return [m.last.gates_UE.clone() for _, m in ml.molora_modules(model)]


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_incremental_decoding_matches_full_forward(tiny_model_dir, router):
    """Greedy decoding one token at a time with a KV cache, then one forward over prompt + completion: the
    same gates (bit for bit, sequence router) and the same logits."""
    model = load_base(tiny_model_dir)
    ml.attach_molora(model, MoLoRAConfig(num_experts=4, rank=4, router=router, top_k=2))
    randomise(model)
    ids, mask = left_pad(PROMPTS)
    steps, step_logits, step_gates = 6, [], []
    with torch.no_grad(), ml.routing_from_prompts(model, PROMPTS) as summary:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True)
        step_gates.append(_gates_by_module(model))
        full_ids, full_mask = ids, mask
        for _ in range(steps):
            step_logits.append(out.logits[:, -1])
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            full_ids = torch.cat([full_ids, token], 1)
            full_mask = torch.cat([full_mask, torch.ones_like(token)], 1)
            out = model(input_ids=token, attention_mask=full_mask, position_ids=positions(full_mask)[:, -1:],
                        past_key_values=out.past_key_values, use_cache=True)
            step_gates.append(_gates_by_module(model))
        full = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions(full_mask)).logits
        full_gates = _gates_by_module(model)
    T = ids.shape[1]
    torch.testing.assert_close(full[:, T - 1:T - 1 + steps], torch.stack(step_logits, 1), atol=1e-5, rtol=0)
    if router == "sequence":
        assert summary.shape == (2, 64)
        for gates in step_gates:
            assert all(torch.equal(a, b) for a, b in zip(gates, full_gates))
        assert not all(torch.equal(g[0], g[1]) for g in full_gates)  # the two prompts are routed differently
    else:  # the last generated token's gates: from the step that fed it and from the full forward
        for a, b in zip(step_gates[-1], full_gates):
            torch.testing.assert_close(a, b.view(2, -1, 4)[:, -1], atol=1e-5, rtol=0)


def test_generate_matches_training_forward(tiny_model_dir):
    """transformers generate (KV cache) inside the routing context, then the training-style forward."""
    model = load_base(tiny_model_dir)
    ml.attach_molora(model, MoLoRAConfig(num_experts=3, rank=4, router="sequence", top_k=1, hydra=True))
    randomise(model)
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad(), ml.routing_from_prompts(model, PROMPTS):
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        sample_gates = _gates_by_module(model)
        full_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], 1)
        full = model(input_ids=gen.sequences, attention_mask=full_mask, position_ids=positions(full_mask)).logits
    T = ids.shape[1]
    torch.testing.assert_close(full[:, T - 1:-1], torch.stack(gen.logits, 1), atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(sample_gates, _gates_by_module(model)))


def test_aux_losses_and_metrics_on_model(tiny_model_dir):
    model = load_base(tiny_model_dir)
    cfg = MoLoRAConfig(num_experts=3, rank=2, router="token", top_k=2, balance_coef=0.1, z_coef=0.01)
    ml.attach_molora(model, cfg)
    randomise(model)
    ids, mask = left_pad(PROMPTS)
    model(input_ids=ids, attention_mask=mask)
    aux = ml.collect_aux_losses(model, mask)
    want_balance = want_z = 0.0
    for _, m in ml.molora_modules(model):
        rec = m.last
        keep = mask.reshape(-1).bool()
        want_balance = want_balance + ml.balance_loss(rec.logits_UE[keep], rec.chosen_UK[keep])
        want_z = want_z + ml.z_loss(rec.logits_UE[keep])
    assert aux.modules == 14
    torch.testing.assert_close(aux.balance, want_balance)
    torch.testing.assert_close(aux.z, want_z)
    torch.testing.assert_close(aux.total, 0.1 * want_balance + 0.01 * want_z)
    assert not torch.allclose(ml.collect_aux_losses(model).balance, aux.balance)  # padding counts without the mask
    metrics = ml.router_metrics(model, mask)
    assert sum(metrics[f"molora/util_{e}"] for e in range(3)) == pytest.approx(1.0)
    assert 0 < metrics["molora/entropy"] <= math.log(3) + 1e-6
    assert metrics["molora/balance"] == pytest.approx(aux.balance.item() / 14, rel=1e-5)
    with pytest.raises(RuntimeError, match="does not match"):
        ml.collect_aux_losses(model, mask[:, 1:])


@pytest.mark.parametrize("router,hydra", [("token", False), ("sequence", True)])
def test_gradients_reach_experts_and_routers_only(tiny_model_dir, router, hydra):
    model = load_base(tiny_model_dir)
    params = ml.attach_molora(model, MoLoRAConfig(num_experts=3, rank=2, router=router, top_k=3, hydra=hydra))
    randomise(model)
    ids, mask = left_pad(PROMPTS)
    with ml.routing_from_prompts(model, PROMPTS):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    (loss + ml.collect_aux_losses(model, mask).total).backward()
    trainable = {id(p) for p in params}
    for name, param in model.named_parameters():
        if id(param) in trainable:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None and not param.requires_grad, name


def test_fresh_routers_learn_from_aux_losses(tiny_model_dir):
    """At start B = 0, so the task loss moves B only; the aux losses already reach the routers."""
    model = load_base(tiny_model_dir)
    ml.attach_molora(model, MoLoRAConfig(num_experts=3, rank=2, router="sequence", top_k=1))
    ids, mask = left_pad(PROMPTS)
    with ml.routing_from_prompts(model, PROMPTS):
        task = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    layers = [m for _, m in ml.molora_modules(model)]
    routers, Bs = [m.molora_router.weight for m in layers], [m.molora_B for m in layers]
    grads = torch.autograd.grad(task, routers + Bs, retain_graph=True, allow_unused=True)
    assert all(g is None or g.abs().sum() == 0 for g in grads[:len(routers)])
    assert all(g.abs().sum() > 0 for g in grads[len(routers):])
    aux_grads = torch.autograd.grad(ml.collect_aux_losses(model).total, routers)
    assert all(g.abs().sum() > 0 for g in aux_grads)


# ---- saving and loading ------------------------------------------------------------------------------------
