"""Rows' own adapters inside a mixture's sparse block (models/block_routing.py): several policies whose LoRA sits on
the fused experts, the router and Qwen2-MoE's shared expert give each row what its policy gives it alone (outputs and
gradients, float64), and what cannot be routed by row is refused in one line. rlora serve's routed pass is tested in
tests/test_expert_lora.py and tests/test_mixture_of_experts.py; whole runs in tests/test_policies_runs.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlora.config import LoraConfig
from rlora.errors import UserError
from rlora.models import block_routing
from rlora.models import multi_lora as mlr
from rlora.models.tiny import build_random_model

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("block_routing")
    return {name: str(build_random_model(root / name, family=name, tie=False, seed=2)) for name in FAMILIES}


def policies_model(folder, names=("a", "b", "c")):
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    base.config._experts_implementation = "eager"  # transformers' grouped kernel takes no float64
    base.requires_grad_(False)
    model = mlr.attach_policies(base, LoraConfig(rank=4, alpha=8), list(names), [1, 2, 3][:len(names)])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_several_policies_in_a_sparse_block_give_each_row_its_own(family_dirs, family):
    """Rows of three policies, interleaved, in one forward and backward against each policy's rows alone: every
    logit and every LoRA gradient (experts, routers, shared experts, attention) to 1e-12; with the policies off the
    base."""
    model = policies_model(family_dirs[family])
    adapted = {name.split(".mlp.")[1].split(".")[0] for name, _ in model.named_parameters() if ".mlp." in name
               and "lora_" in name}
    # peft's all-linear: Qwen2-MoE's shared expert and dense MLPs; the others' fused experts and router (on Qwen3-MoE
    # peft moves the dense layer's MLP names onto the experts too)
    assert adapted == ({"shared_expert", "shared_expert_gate", "gate_proj", "up_proj", "down_proj"}
                       if family == "qwen2_moe" else {"experts", "gate"})
    ids_BT = torch.randint(0, 300, (5, 7), generator=torch.Generator().manual_seed(1))
    policy_B = torch.tensor([2, 0, 2, 1, 0])
    with mlr.policy_rows(model, policy_B):
        together = model(input_ids=ids_BT).logits
    together.sin().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    alone = torch.empty_like(together)
    for k in range(3):
        rows = (policy_B == k).nonzero().squeeze(-1)
        with mlr.policy_rows(model, policy_B[rows]):
            logits = model(input_ids=ids_BT[rows]).logits
        logits.sin().sum().backward()
        alone[rows] = logits.detach()
    torch.testing.assert_close(together.detach(), alone, rtol=0, atol=1e-12)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-12, msg=name)
    assert len(grads) == sum(p.requires_grad for p in model.parameters())
    with torch.no_grad(), mlr.policies_disabled(model), mlr.policy_rows(model, policy_B):
        off = model(input_ids=ids_BT).logits
    base = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float64)
    base.config._experts_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(off, base(input_ids=ids_BT).logits, rtol=0, atol=1e-12)
    assert (off - together).abs().max() > 1e-3


def test_experts_of_another_layout_are_refused_for_several_policies(family_dirs):
    """Fused experts whose layout models/expert_lora.py does not compute (here: marked as stored [E, in, out]) cannot
    be routed by row: several policies refuse them in one line, naming what to target instead; the router and the
    shared expert's linear maps can be."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    base = AutoModelForCausalLM.from_pretrained(family_dirs["mixtral"])
    for module in base.modules():
        if type(module).__name__ == "MixtralExperts":
            module.is_transposed = True
    with pytest.raises(UserError, match=r"policies: peft's LoRA on 'experts.*lora.target_modules=\[q_proj"):
        mlr.attach_policies(base, LoraConfig(rank=4, alpha=8), ["a", "b"], [1, 2])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(family_dirs["qwen2_moe"]),
                           PeftLoraConfig(target_modules="all-linear", r=2))
    block = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    assert block_routing.token_routable(block.shared_expert.gate_proj, block)


def test_a_block_fed_tokens_that_are_not_whole_rows_is_refused():
    """Tokens in a block are rows of T: a count that is not (a wrong policy list) raises rather than guessing."""
    assert block_routing.token_slots(torch.tensor([1, 0]), 6).tolist() == [1, 1, 1, 0, 0, 0]
    with pytest.raises(RuntimeError, match="7 tokens in a sparse block for 2 rows"):
        block_routing.token_slots(torch.tensor([1, 0]), 7)


def test_a_policies_forward_with_another_count_of_rows_is_refused(family_dirs):
    """Policies on the experts alone (nothing outside the block to check the rows): rows' policies for 2 rows around
    a forward of 4 rows raise instead of sending rows 0-1 through one policy and 2-3 through the other; with the
    policies off (the reference) the block runs."""
    base = AutoModelForCausalLM.from_pretrained(family_dirs["qwen3_moe"])  # peft moves these names onto the experts
    model = mlr.attach_policies(base, LoraConfig(rank=4, alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
                                ["a", "b"], [1, 2])
    assert {n.split(".mlp.")[1].split(".")[0] for n, p in model.named_parameters() if p.requires_grad} == {"experts"}
    ids_BT = torch.randint(0, 300, (4, 3), generator=torch.Generator().manual_seed(3))
    with mlr.policy_rows(model, torch.tensor([0, 1])), pytest.raises(RuntimeError, match="4 rows in a sparse block"):
        model(input_ids=ids_BT)
    with mlr.policy_rows(model, torch.tensor([0, 1])), mlr.policies_disabled(model), torch.no_grad():
        assert torch.isfinite(model(input_ids=ids_BT).logits).all()


def test_lora_layers_that_peft_would_widen_onto_experts_are_refused_for_several_policies(tmp_path):
    """As for one policy (tests/test_mixture_of_experts.py): peft puts the experts' LoRA on every sparse layer,
    whatever lora.top_layers says; refused in one line instead of training a layer the run keeps frozen."""
    folder = build_random_model(tmp_path / "m", family="qwen3_moe", layers=3, tie=False)  # layer 0 dense, 1-2 sparse
    base = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(UserError, match=r"peft also put LoRA on layers \[1\]"):
        mlr.attach_policies(base, LoraConfig(rank=4, alpha=8, top_layers=1,
                                             target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
                            ["a", "b"], [1, 2])
