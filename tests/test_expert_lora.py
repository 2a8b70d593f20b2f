"""peft's LoRA on a mixture's fused experts computed on the activations (models/expert_lora.py) against peft's own
weight-side forward: the same outputs and gradients in float64, the adapters off or merged as peft runs them, no
tensor the size of the expert stack held for the backward, and what is left on peft's path."""

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from rlora.config import LoraConfig, ModelConfig
from rlora.models import expert_lora
from rlora.models.loading import attach_lora, load_base_model
from rlora.models.named_adapters import attach_named
from rlora.models.tiny import build_random_model

ADAPTED = ("mixtral", "qwen3_moe", "olmoe")  # Qwen2-MoE: peft's all-linear adapts no expert parameter there


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_lora")
    return {name: str(build_random_model(root / name, family=name, tie=False, seed=5)) for name in ADAPTED}


def float64_model(folder, **lora):
    """A float64 model with a random (B != 0) LoRA of `lora`'s peft settings, on peft's path; eager experts so
    that peft's forward runs the plain per-expert products."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model.config._experts_implementation = "eager"
    torch.manual_seed(0)
    return get_peft_model(model, PeftLoraConfig(init_lora_weights=False, **({"target_modules": "all-linear", "r": 4,
                                                                              "lora_alpha": 8} | lora)))


def outputs_and_grads(model, ids_BT):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids_BT).logits
    logits.sin().sum().backward()  # a loss whose gradient differs per logit
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


def assert_same_as_peft(model, ids_BT, atol=1e-12):
    expert_lora.uninstall(model)
    want, want_grads = outputs_and_grads(model, ids_BT)
    assert expert_lora.install(model) > 0
    got, got_grads = outputs_and_grads(model, ids_BT)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert got_grads.keys() == want_grads.keys() and any("experts" in name for name in got_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("family", ADAPTED)
def test_the_same_outputs_and_gradients_as_peft(family_dirs, family):
    """Every logit and every trainable parameter's gradient (experts, router, attention, dense maps) as peft's
    forward computes them, to 1e-12 in float64 (reassociation only: W x + s B (A x) against (W + s B A) x)."""
    model = float64_model(family_dirs[family])
    ids_BT = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    assert_same_as_peft(model, ids_BT)
    with model.disable_adapter():  # off: the base's experts, as peft runs them
        base = model(input_ids=ids_BT).logits
        expert_lora.uninstall(model)
        torch.testing.assert_close(model(input_ids=ids_BT).logits, base, rtol=0, atol=0)
    expert_lora.install(model)
    assert (model(input_ids=ids_BT).logits - base).abs().max() > 1e-3  # the adapter does change the outputs


def test_one_projection_adapted_and_two_adapters_active_at_once(family_dirs):
    """A LoRA on down_proj alone (the gate/up products then the base's), and two adapters of other ranks and scales
    (rsLoRA beside plain) active together (their deltas summed, as peft sums them)."""
    folder = family_dirs["qwen3_moe"]
    ids_BT = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    only_down = float64_model(folder, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    assert_same_as_peft(only_down, ids_BT)
    two = float64_model(folder, use_rslora=True)  # scale alpha / sqrt(r), read from peft, not recomputed
    torch.manual_seed(1)
    two.add_adapter("second", PeftLoraConfig(init_lora_weights=False, target_modules="all-linear", r=2, lora_alpha=3))
    two.base_model.set_adapter(["default", "second"])
    for name, p in two.named_parameters():  # set_adapter leaves one trainable: the gradients of both are compared
        p.requires_grad_("lora_" in name)
    assert_same_as_peft(two, ids_BT)


def test_merged_adapters_run_the_base_on_merged_weights(family_dirs):
    """Merged into the experts (rlora merge), the wrapper runs its base, which holds the LoRA already: the outputs of
    the unmerged activation-side forward."""
    model = float64_model(family_dirs["mixtral"])
    ids_BT = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(3))
    expert_lora.install(model)
    with torch.no_grad():
        unmerged = model(input_ids=ids_BT).logits
        model.merge_adapter()
        merged = model(input_ids=ids_BT).logits
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-12)


def big_saved_storages(model, ids_BT, min_bytes):
    """How many storages of at least min_bytes the forward saves tensors of (or views into) for the backward, the
    parameters' own left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    big = set()

    def pack(t):
        storage = t.untyped_storage()
        if storage.nbytes() >= min_bytes and storage.data_ptr() not in params:
            big.add(storage.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids_BT).logits.sum().backward()
    return len(big)


def test_no_tensor_the_size_of_the_expert_stack_is_held_for_the_backward(family_dirs):
    """peft holds W + s B A of every expert of every sparse layer until the backward; on the activations nothing
    that size is kept (the point of it for a 128-expert model: a second copy of every layer's experts)."""
    model = float64_model(family_dirs["olmoe"])
    experts = next(m for m in model.modules() if type(m).__name__ == "OlmoeExperts")
    stack = experts.gate_up_proj.numel() * experts.gate_up_proj.element_size()
    ids_BT = torch.randint(0, 300, (1, 4), generator=torch.Generator().manual_seed(4))  # few tokens: nothing else big
    expert_lora.uninstall(model)
    layers = model.config.num_hidden_layers
    assert big_saved_storages(model, ids_BT, stack) >= layers  # peft: at least one stack per layer
    expert_lora.install(model)
    assert big_saved_storages(model, ids_BT, stack) == 0


def test_routing_ids_past_the_last_expert_are_dropped(family_dirs):
    """An expert-parallel sentinel (an id >= num_experts) routes its token nowhere, as transformers' experts skip it."""
    model = float64_model(family_dirs["qwen3_moe"])
    expert_lora.install(model)
    outer = next(m.experts for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    wrappers, experts = expert_lora.chain(outer)
    hidden_SH = torch.randn(3, experts.gate_up_proj.shape[-1], dtype=torch.float64)
    index_SK = torch.tensor([[0, 1], [1, experts.num_experts], [experts.num_experts, experts.num_experts]])
    weights_SK = torch.full((3, 2), 0.5, dtype=torch.float64)
    out = expert_lora.experts_forward(experts, wrappers, hidden_SH, index_SK, weights_SK)
    alone = expert_lora.experts_forward(experts, wrappers, hidden_SH[:2], torch.tensor([[0, 1], [1, 1]]),
                                        torch.tensor([[0.5, 0.5], [0.5, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(out[:2], alone, rtol=0, atol=1e-14)
    assert out[2].abs().max() == 0


def installed(model) -> int:
    return sum(expert_lora.experts_wrapper(m) for m in model.modules())


def test_rlora_attaches_it_and_autocast_stays_close(family_dirs, tmp_path):
    """attach_lora and attach_named put it on every sparse layer; under bf16 autocast (train.autocast) it stays
    within bf16 rounding of peft's path under the same autocast (the two round the LoRA at different points)."""
    folder = family_dirs["qwen3_moe"]
    model = attach_lora(load_base_model(ModelConfig(path=folder), folder), LoraConfig(rank=4, alpha=8))
    sparse = sum(hasattr(m, "experts") and hasattr(m, "gate") for m in model.modules())
    assert installed(model) == sparse > 0 and expert_lora.install(model) == sparse  # idempotent
    model.save_pretrained(tmp_path / "adapter")
    named = attach_named(load_base_model(ModelConfig(path=folder), folder), {"a": str(tmp_path / "adapter")}, "m")
    assert installed(named) == sparse
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids_BT = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got = model(input_ids=ids_BT).logits.float()
        expert_lora.uninstall(model)
        want = model(input_ids=ids_BT).logits.float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_an_unknown_layout_stays_on_peft(family_dirs):
    """An experts module whose weights are stored transposed ([E, in, out]) is left to peft's forward."""
    model = float64_model(family_dirs["mixtral"])
    for module in model.modules():
        if type(module).__name__ == "MixtralExperts":
            module.is_transposed = True
    assert expert_lora.install(model) == 0


def test_a_copy_of_the_model_computes_with_its_own_adapter(family_dirs):
    """The forward is bound to its wrapper, not closed over it: a deep copy (as a caller may make of a model) runs
    its own factors."""
    import copy

    model = float64_model(family_dirs["olmoe"])
    expert_lora.install(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "experts" in name and "lora_B" in name:
                p.mul_(3)
    ids_BT = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (twin(input_ids=ids_BT).logits - model(input_ids=ids_BT).logits).abs().max() > 1e-6
        expert_lora.uninstall(twin)
        expected = twin(input_ids=ids_BT).logits
        expert_lora.install(twin)
        torch.testing.assert_close(twin(input_ids=ids_BT).logits, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_a_routed_pass_sends_each_rows_tokens_through_its_own_adapter(tmp_path, family):
    """routed_adapters (rlora serve's batched pass) inside a sparse block: the experts' and the router's LoRA (OLMoE)
    or the shared expert's linear maps (Qwen2-MoE) take each row's tokens through that row's adapter: the rows of
    one routed forward equal each adapter's rows run alone, in float64. Without the rows' length the block's
    flattened tokens are refused, not routed by a guess."""
    from rlora.models.routed_adapters import routed_adapters

    folder = str(build_random_model(tmp_path / family, family=family, tie=False, seed=5))
    model = float64_model(folder)
    torch.manual_seed(2)
    model.add_adapter("b", PeftLoraConfig(init_lora_weights=False, target_modules="all-linear", r=2, lora_alpha=5))
    expert_lora.install(model)
    ids_BT = torch.randint(0, 300, (3, 6), generator=torch.Generator().manual_seed(7))
    alone = []
    with torch.no_grad():
        for name, rows in (("default", slice(0, 2)), ("b", slice(2, 3))):
            model.set_adapter(name)
            alone.append(model(input_ids=ids_BT[rows]).logits)
        with routed_adapters(model, ["default", "b"]) as routes:
            with routes.routed([(0, 2), (1, 1)], dims=3, row_tokens=6):
                routed = model(input_ids=ids_BT).logits
            with routes.routed([(0, 2), (1, 1)], dims=3), pytest.raises(RuntimeError, match="were routed"):
                model(input_ids=ids_BT)
    torch.testing.assert_close(routed, torch.cat(alone), rtol=0, atol=1e-12)
    with torch.no_grad():  # the two adapters differ inside the block: a row through the other one would show
        model.set_adapter("default")
        assert (model(input_ids=ids_BT[2:]).logits - alone[1]).abs().max() > 1e-6
