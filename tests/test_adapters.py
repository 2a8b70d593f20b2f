"""The policy-adapter protocol (models/adapters.py) for each kind (one peft LoRA, several batched LoRA policies,
MoLoRA): disabled() is the base exactly, the trainable parameters are exactly the adapter's, split by policy, and
save/load round-trips every policy's weights; adapter_of tells the kinds apart."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlora.config import LoraConfig
from rlora.models import molora as ml
from rlora.models import multi_lora as mlr
from rlora.models.adapters import MoLoRA, MultiLora, PeftLora, adapter_of
from rlora.models.loading import attach_lora
from rlora.models.molora import MoLoRAConfig

IDS = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(2))


def base_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.requires_grad_(False)
    return model


def with_random_up_factors(model, tag: str):
    """The adapter's B (up) factors random, so the adapter changes the outputs (peft and MoLoRA start B at 0)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if tag in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return model


def build(kind: str, model_dir):
    """-> (model, its adapter, the parameter-name marker of each policy)."""
    base = base_model(model_dir)
    if kind == "peft":
        model = with_random_up_factors(attach_lora(base, LoraConfig(rank=4, alpha=8)), "lora_B")
        return model, PeftLora(model), ["lora_"]
    if kind == "multi":
        model = with_random_up_factors(mlr.attach_policies(base, LoraConfig(rank=4, alpha=8), ["a", "b"], [1, 2]),
                                       "lora_B")
        return model, MultiLora(model), [f".{mlr.PEFT_NAME.format(n)}." for n in ("a", "b")]
    ml.attach_molora(base, MoLoRAConfig(num_experts=2, top_k=2, rank=2, router="token", router_init_std=0.3))
    model = with_random_up_factors(base, "molora_B").double()
    return model, MoLoRA(model), [ml.PARAM_TAG]


def logits(adapter, model) -> torch.Tensor:
    with torch.no_grad(), adapter.rows(torch.tensor([0, 1]) if len(adapter.names) > 1 else None):
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("kind,cls", [("peft", PeftLora), ("multi", MultiLora), ("molora", MoLoRA)])
def test_each_kind_is_found_disables_to_the_base_and_owns_exactly_its_parameters(kind, cls, tiny_model_dir):
    model, adapter, markers = build(kind, tiny_model_dir)
    assert type(adapter_of(model)) is cls
    base = logits(adapter, base_model(tiny_model_dir))
    assert not torch.allclose(logits(adapter, model), base)  # the adapter changes the outputs ...
    with torch.no_grad(), adapter.disabled():
        assert torch.equal(model(input_ids=IDS).logits, base)  # ... and the reference is the base exactly
        with adapter.disabled():  # nested: the inner exit leaves it off
            pass
        assert torch.equal(model(input_ids=IDS).logits, base)
    assert torch.equal(logits(adapter, model), logits(adapter, model)) and not torch.allclose(logits(adapter, model), base)
    per_policy = adapter.parameters_per_policy()
    assert len(per_policy) == len(adapter.names) == len(markers)
    names = {id(p): n for n, p in model.named_parameters()}
    for params, marker in zip(per_policy, markers):
        assert params and all(marker in names[id(p)] for p in params)
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(id(p) for params in per_policy for p in params) == sorted(trainable)
    assert adapter.aux_loss_every_row == (kind == "molora")  # MoLoRA's default coefficients are non-zero
    assert (adapter.aux_loss([], None) is None) == (kind != "molora")


@pytest.mark.parametrize("kind", ["peft", "multi", "molora"])
def test_save_then_load_puts_each_policys_weights_back(kind, tiny_model_dir, tmp_path):
    _, adapter, _ = build(kind, tiny_model_dir)
    saved = [[p.detach().clone() for p in params] for params in adapter.parameters_per_policy()]
    for k in range(len(adapter.names)):
        adapter.save(tmp_path / str(k), k)
    with torch.no_grad():
        for params in adapter.parameters_per_policy():
            for p in params:
                p.zero_()
    for k in range(len(adapter.names)):
        adapter.load(tmp_path / str(k), k)
    for want, params in zip(saved, adapter.parameters_per_policy()):
        assert all(torch.equal(w, p) for w, p in zip(want, params))


@pytest.mark.parametrize("kind", ["peft", "multi", "molora"])
def test_sampler_policies_route_only_where_the_model_serves_several(kind, tiny_model_dir):
    """What the step and the evaluation pass the sampler: an adapter of one policy takes the sampler's plain path
    (None: one seed, no policies, as transformers generate takes) and refuses a policy it does not have; several
    policies are passed on as they are."""
    _, adapter, _ = build(kind, tiny_model_dir)
    if kind == "multi":
        assert adapter.sampler_policies([1, 0, 1]) == [1, 0, 1]
        return
    assert adapter.sampler_policies([0, 0, 0]) is None and adapter.sampler_policies([]) is None
    with pytest.raises(ValueError, match="policy 1 asked of an adapter that serves one policy"):
        adapter.sampler_policies([0, 1])


@pytest.mark.parametrize("kind", ["peft", "multi", "molora-token", "molora-sequence"])
def test_prompt_routing_routes_each_row_by_its_own_prompt_only_where_a_sequence_router_does(kind, tiny_model_dir):
    """What `rlora sft` runs each forward in: a sequence router's rows take the gates of their own prompts (row 1
    alone gives the same logits as inside the batch; other prompts change them); every other kind is unchanged."""
    if kind.startswith("molora"):
        base = base_model(tiny_model_dir)
        ml.attach_molora(base, MoLoRAConfig(num_experts=2, top_k=1, rank=2, router=kind.split("-")[1],
                                            router_init_std=0.5))
        model, adapter = with_random_up_factors(base, "molora_B").double(), MoLoRA(base)
    else:
        model, adapter, _ = build(kind, tiny_model_dir)
    prompts = [[5, 6, 7], [40, 41]]
    rows = torch.tensor([0, 1]) if len(adapter.names) > 1 else None

    def routed_logits(ids, prompt_lists):
        with torch.no_grad(), adapter.rows(rows if len(ids) == 2 else None), adapter.prompt_routing(prompt_lists):
            return model(input_ids=ids).logits

    together = routed_logits(IDS, prompts)
    if kind == "molora-sequence":
        assert adapter.batch_aux_loss([torch.ones_like(IDS)], prompts, lambda i: None) is not None
        assert not torch.allclose(together, routed_logits(IDS, prompts[::-1]))
        alone = routed_logits(IDS[1:], prompts[1:])
        torch.testing.assert_close(together[1:], alone, rtol=0, atol=1e-12)
        return
    assert torch.equal(together, routed_logits(IDS, prompts[::-1]))
    assert (adapter.batch_aux_loss([torch.ones_like(IDS)], prompts, lambda i: None) is None) == (kind != "molora-token")
