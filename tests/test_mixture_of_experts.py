"""The built-in sampler and the trainer on the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; tiny random
models of models/tiny.py, 4 experts, 2 a token): what runs a sparse layer, peft's expert LoRA merged once per sampling
call, no CUDA graph, and what is refused with a one-line error (sampling and log-probs against transformers are in
tests/test_engine_families.py and tests/test_trainer_families.py with the other families)."""

import dataclasses

import numpy as np
import pytest
import torch
from test_engine import policy
from transformers import AutoModelForCausalLM

from rlora.config import LoraConfig, ModelConfig, MoLoRAConfig
from rlora.errors import UserError
from rlora.models import molora as ml
from rlora.models import multi_lora as mlr
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer
from rlora.models.named_adapters import attach_named
from rlora.models.tiny import build_random_model
from rlora.rollout.decoder import DecoderView, unsupported_reason
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams

MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtures")
    return {name: str(build_random_model(root / name, family=name, tie=False, seed=3)) for name in MIXTURES}


def base(folder):
    return load_base_model(ModelConfig(path=folder), folder)



def test_a_mixture_of_experts_block_runs_whole_and_is_never_graphed(family_dirs, tmp_path):
    """The sparse layers run the model's own block (its router picks each token's experts), the dense layers of
    Qwen2/3-MoE the gated program; a CUDA graph is not promised for such a block, so 'auto' decodes eagerly on a
    GPU and 'graph' is refused (the device is only named here: the choice is made before any kernel runs)."""
    for family in MIXTURES:
        model = AutoModelForCausalLM.from_pretrained(family_dirs[family])
        view = DecoderView.of(model, merge=True)
        kinds = [type(layer.mlp).__name__ for layer in view.layers]
        sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
        assert kinds == ["BlockMLP" if s else "GatedMLP" for s in sparse], family
        assert any(sparse) and (family in ("mixtral", "olmoe") or not all(sparse)), family
        assert not view.graphable
        on_gpu = dataclasses.replace(view, device=torch.device("cuda"))
        assert BuiltinGenerator(None, [0], 0)._decode_mode(on_gpu) == "eager"
        with pytest.raises(ValueError, match="no mixture-of-experts block"):
            BuiltinGenerator(None, [0], 0, decode="graph")._decode_mode(on_gpu)
    dense_dir = build_random_model(tmp_path / "qwen3", family="qwen3", tie=False)
    dense = DecoderView.of(AutoModelForCausalLM.from_pretrained(dense_dir), merge=True)
    assert dense.graphable and BuiltinGenerator(None, [0], 0)._decode_mode(
        dataclasses.replace(dense, device=torch.device("cuda"))) == "graph"


def test_olmoe_clipped_attention_is_refused(family_dirs):
    model = AutoModelForCausalLM.from_pretrained(family_dirs["olmoe"])
    assert unsupported_reason(model, max_length=64) is None
    model.config.clip_qkv = 8.0
    assert unsupported_reason(model, max_length=64) == "clip_qkv (clamped queries, keys and values)"


def test_lora_layers_that_peft_would_widen_on_experts_are_refused(family_dirs):
    """peft turns listed MLP names into a mixture's fused expert parameters and places those on every sparse layer
    whatever lora.layers says; rlora refuses that instead of training other layers than asked."""
    folder = family_dirs["qwen3_moe"]  # layer 0 dense (its gate/up/down_proj named), layer 1 sparse
    mlp = ["q_proj", "gate_proj", "up_proj", "down_proj"]  # named, so peft maps them onto the experts
    with pytest.raises(UserError, match=r"peft also put LoRA on layers \[1\]"):
        attach_lora(base(folder), LoraConfig(rank=4, alpha=8, layers=[0], target_modules=mlp))
    model = attach_lora(base(folder), LoraConfig(rank=4, alpha=8, layers=[0], target_modules=["q_proj", "v_proj"]))
    assert {n.split(".layers.")[1][0] for n, m in model.named_modules() if hasattr(m, "lora_A")} == {"0"}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_the_experts_lora_is_merged_once_per_view(family_dirs, family):
    """peft puts these families' 'all-linear' LoRA on the fused experts (and on some routers): a merged view sums it
    into new tensors once (the parameters stay as they were), runs the block on them with peft's wrappers off, and puts
    the wrappers back as they were; the reference policy (adapter off) merges nothing; the rows' outputs equal the
    block's own forward with peft adding the delta."""
    _, _, model, _ = policy(family_dirs[family])
    view = DecoderView.of(model, merge=True)
    blocks = [layer.mlp for layer in view.layers if type(layer.mlp).__name__ == "BlockMLP"]
    assert blocks and all(any("experts" in path for path in block.merged) for block in blocks)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for block in blocks:
        params = {path: block.block.get_parameter(path).clone() for path in block.merged}
        with torch.no_grad():
            assert torch.allclose(block(x), block.block(x[:, None])[:, 0], atol=1e-6, rtol=0)
        assert not any(m._disable_adapters for m in block.block.modules() if hasattr(m, "lora_A"))
        assert all(torch.equal(block.block.get_parameter(p), t) for p, t in params.items())
        assert all(not torch.equal(block.merged[p], t) for p, t in params.items())
    with model.disable_adapter():
        reference = DecoderView.of(model, merge=True)
    assert all(not layer.mlp.merged for layer in reference.layers if type(layer.mlp).__name__ == "BlockMLP")



def test_a_sequence_router_refuses_a_module_inside_a_sparse_block(family_dirs):
    """Qwen2-MoE's shared expert (plain linear maps inside the sparse block) sees the block's tokens, not rows: a
    MoLoRA sequence router refuses it in one line; a token router adapts it (several policies route the block's
    tokens by their rows: tests/test_block_routing.py)."""
    folder = family_dirs["qwen2_moe"]
    with pytest.raises(UserError, match="MoLoRA's sequence router cannot route 'shared_expert.gate_proj'"):
        ml.attach_molora(base(folder), MoLoRAConfig(num_experts=2, top_k=1, router="sequence", rank=4))
    model = base(folder)
    ml.attach_molora(model, MoLoRAConfig(num_experts=2, top_k=1, router="token", rank=4))
    assert any(".shared_expert." in name for name, _ in ml.molora_modules(model))
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7], [8, 9, 10]])).logits).all()


@pytest.mark.parametrize("family,targets", [("qwen3_moe", ATTENTION), ("qwen3_moe", "all-linear"),
                                            ("qwen2_moe", "all-linear"), ("mixtral", "all-linear")])
def test_several_policies_on_a_mixture_sample_each_as_alone(family_dirs, family, targets):
    """Two policies on a mixture's attention maps, or on every linear map with its fused experts, router and shared
    expert (each token through its row's policy, models/block_routing.py), sampled in one batch against each policy
    sampled on its own (the other policy's rows absent)."""
    folder = family_dirs[family]
    tokenizer, tok = load_tokenizer(folder)
    model = mlr.attach_policies(base(folder), LoraConfig(rank=4, alpha=8, target_modules=targets), ["a", "b"], [1, 2])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 3 + 4?", "a b c")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=False)
    together = engine.sample(model, prompts * 2, 2, params, [100, 100, 101, 101], keys=[0, 1, 0, 1], policies=[0, 0, 1, 1])
    for k in (0, 1):
        alone = engine.sample(model, prompts, 2, params, [100 + k] * 2, keys=[0, 1], policies=[k, k])
        rows = slice(4 * k, 4 * k + 4)
        assert together.completions[rows] == alone.completions
        assert torch.allclose(together.sampling_logp_BTc[rows], alone.sampling_logp_BTc, atol=1e-5, rtol=0)
    assert together.completions[:4] != together.completions[4:]


def test_serve_batches_attention_and_expert_clients_each_as_alone(tmp_path, monkeypatch):
    """rlora serve on a mixture of experts: a client whose LoRA sits inside a sparse block (train_mlp: peft moves
    the dense layer's MLP names onto the fused experts and the router) sees tokens there, not rows; the batched pass
    routes each row's tokens through its own client's experts and router (models/routed_adapters.py), so attention
    clients and expert clients share one pass, each getting the outputs and gradients it gets alone, also with
    micro-batches that mix clients. Where no MLP has a linear layer (Mixtral), train_mlp adapts the experts' fused
    weights: they train, and the sampler's log-probs are the server's forward's."""
    import tinker
    from serve_helpers import KEY, running_server
    from test_serve_batching import assert_close, assert_same_output, batched_then_alone, ce_datum, grads

    from rlora.serve import datum_rows

    folder = str(build_random_model(tmp_path / "qwen3_moe", family="qwen3_moe", tie=False, seed=0))
    data = [[[5, 17, 33, 8, 41], [12, 7, 19, 60, 3]], [[30, 31, 32, 33, 34, 35], [2, 4, 6, 8]],
            [[11, 22, 33, 44, 55, 6, 7], [8, 18, 28]], [[9, 8, 7, 6], [40, 41, 42, 43, 44, 45, 46]]]
    specs = [dict(rank=4, train_mlp=False), dict(rank=2, train_mlp=False, train_unembed=False), dict(rank=4),
             dict(rank=2, train_attn=False, train_unembed=False)]
    with running_server(folder, tmp_path / "state") as (url, served):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        server = type("Server", (), dict(served=served, worker=served.worker))
        pairs = [[service.create_lora_training_client(base_model=folder, seed=7 + k, **spec).result() for _ in "ab"]
                 for k, spec in enumerate(specs)]
        assert all(served.worker.trainee(p[0].model_id).routable for p in pairs)
        experts = [n for n, p in served.worker.model.named_parameters()
                   if any(p is q for q in served.worker.trainee(pairs[3][0].model_id).params)]
        assert {n.split(".mlp.")[1].split(".")[0] for n in experts if ".layers.1." in n} == {"experts", "gate"}
        for k, pair in enumerate(pairs):
            for client in pair:  # one step each: B no longer 0
                client.forward_backward([ce_datum(s) for s in data[k]], "cross_entropy").result()
                client.optim_step(tinker.types.AdamParams(learning_rate=5e-2)).result()
        monkeypatch.setattr(datum_rows, "MICRO_BATCH_TOKENS", 16)  # micro-batches that mix clients' rows
        requests = [lambda c, k=k: c.forward_backward([ce_datum(s) for s in data[k]], "cross_entropy")
                    for k in range(4)]
        batched, alone = batched_then_alone(server, [p[0] for p in pairs], [p[1] for p in pairs], requests)
        for k in range(4):
            assert_same_output(batched[k], alone[k])
            assert_close(grads(server, pairs[k][0]), grads(server, pairs[k][1]))
            assert all(g is not None and g.abs().max() > 0 for g in grads(server, pairs[k][0]))
        service.close("success").result(timeout=30)
    mixtral = str(build_random_model(tmp_path / "mixtral", family="mixtral", tie=False, seed=0))
    with running_server(mixtral, tmp_path / "state2") as (url, served):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        client = service.create_lora_training_client(base_model=mixtral, rank=4, seed=3, train_attn=False,
                                                     train_unembed=False).result()
        trainee = served.worker.trainee(client.model_id)
        names = [n for n, p in served.worker.model.named_parameters() if any(p is q for q in trainee.params)]
        # train_mlp: the experts' fused weights and the router's, as peft's all-linear in `rlora train`
        assert {n.split(".mlp.")[1].split(".")[0] for n in names} == {"experts", "gate"}
        assert trainee.routable
        before = client.save_weights_and_get_sampling_client().result()
        for _ in range(2):
            client.forward_backward([ce_datum(s) for s in data[0]], "cross_entropy").result()
            client.optim_step(tinker.types.AdamParams(learning_rate=5e-2)).result()
        sampler = client.save_weights_and_get_sampling_client().result()
        prompt = tinker.types.ModelInput.from_ints(data[1][0])
        result = sampler.sample(prompt, 2, tinker.types.SamplingParams(max_tokens=6, seed=3)).result()
        datums = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints((data[1][0] + q.tokens)[:-1]),
                                     loss_fn_inputs={"target_tokens": (data[1][0] + q.tokens)[1:]})
                  for q in result.sequences]
        forward = client.forward(datums, "cross_entropy").result()
        for seq, out in zip(result.sequences, forward.loss_fn_outputs):
            assert np.abs(np.array(seq.logprobs) - out["logprobs"].to_numpy()[len(data[1][0]) - 1:]).max() < 1e-4
        first = before.compute_logprobs(prompt).result()[1:]
        assert np.abs(np.array(first) - np.array(sampler.compute_logprobs(prompt).result()[1:])).max() > 1e-3
        client.save_weights_for_sampler("experts").result()  # a PEFT folder, to load beside an `rlora train` adapter
        service.close("success").result(timeout=30)
    folder = next((tmp_path / "state2").rglob("experts/adapter_config.json")).parent
    trained = attach_lora(base(mixtral), LoraConfig(rank=4, alpha=8))
    trained.save_pretrained(tmp_path / "trained")
    both = attach_named(base(mixtral), {"serve": str(folder), "train": str(tmp_path / "trained")}, "mixtral")
    assert set(both.peft_config) == {"named_serve", "named_train"}  # (before: peft refused the two sets of names)


@pytest.mark.parametrize("family", MIXTURES)
def test_a_layer_list_with_all_linear_is_refused_on_a_mixture(family_dirs, family):
    """With a layer list, 'all-linear' becomes the layers' linear maps, which on a mixture name no expert: peft would
    train attention alone where 'all-linear' without the list adapts the experts. Refused in one line."""
    for layers in (dict(layers=[0, 1]), dict(top_layers=1)):
        with pytest.raises(UserError, match="would leave its experts out"):
            attach_lora(base(family_dirs[family]), LoraConfig(rank=4, alpha=8, **layers))


def test_mixtrals_router_jitter_is_a_dropout(tmp_path):
    """Router jitter multiplies the router's input by fresh noise in every training pass: rlora train turns it off
    with the base's dropouts (the update then computes the sampler's function), and a model that keeps it shares no
    prompt or frozen layer in training."""
    from rlora.models.frozen_prefix import sharing_unsupported
    from rlora.models.dropouts import base_dropouts
    from rlora.models.shared_prompts import sharing_prompts_unsupported

    folder = str(build_random_model(tmp_path / "mixtral", family="mixtral", tie=False, router_jitter_noise=0.5))
    assert base_dropouts(folder) == {"router_jitter_noise": 0.5}
    kept = load_base_model(ModelConfig(path=folder), folder, no_dropout=False)
    assert kept.config.router_jitter_noise == 0.5
    assert load_base_model(ModelConfig(path=folder), folder, no_dropout=True).config.router_jitter_noise == 0.0
    model = attach_lora(kept, LoraConfig(rank=4, alpha=8, target_modules=ATTENTION)).train()
    assert sharing_prompts_unsupported(model) == "dropout in training"
    assert sharing_unsupported(model) == "router_jitter_noise=0.5 makes the lower layers random in training"
