"""Frozen lower layers computed once: policy and reference log-probs (and the adapter's gradients) from
the shared prefix equal those of separate full forward passes, for several adapter depths, on Llama,
Qwen2 and Mistral shapes (with sliding-window layers)."""

import pytest
import torch
from test_policy_model import make_policy, perturb_adapter, sample, vary_lengths

from rlora.models.frozen_prefix import FrozenPrefix, first_adapter_layer
from rlora.models.loading import trainable_parameters
from rlora.models.adapters import reference_policy
from rlora.models.logprobs import completion_logprobs
from rlora.models.shared_prompts import set_prompt_sharing
from rlora.models.tiny import build_random_model
from rlora.batching import trim

FAMILIES = {
    "llama": dict(family="llama"),
    # layers 2 and 3 attend through a 3-token window: the per-layer masks must follow the layer types
    "qwen2-sliding": dict(family="qwen2", tie=False, use_sliding_window=True, sliding_window=3, max_window_layers=2),
    "mistral-sliding": dict(family="mistral", sliding_window=3),
}


@pytest.fixture(scope="module")
def four_layer_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    return {name: str(build_random_model(root / name, layers=4, seed=3, **kwargs)) for name, kwargs in FAMILIES.items()}


def logp_and_grads(model, micro, weights_BT, prefix=None):
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, micro, chunk_tokens=5, prefix=prefix)
    (logp * weights_BT * micro.completion_mask_BTc.float()).sum().backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in trainable_parameters(model)])


# float32: the prefix of a row is computed inside another micro-batch (another padded width), which changes
# the rounding of the reductions: a few ulps of a log-prob (1 ulp is 4.8e-7 at |logp| in [4, 8)), more or
# fewer depending on the CPU's kernels; 1e-5 allows ~20. float64 shows that nothing else differs.
TOLERANCES = {torch.float32: dict(logp=1e-5, grad_atol=1e-5, grad_rtol=1e-5), torch.float64: dict(logp=1e-12,
              grad_atol=1e-12, grad_rtol=0)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("adapter_layers, frozen", [([3], 3), ([2, 3], 2), ([1, 3], 1), (None, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shared_prefix_equals_separate_full_passes(four_layer_models, family, adapter_layers, frozen, dtype):
    tokenizer, tok, model = make_policy(four_layer_models[family], layers=adapter_layers)
    perturb_adapter(model, scale=0.3)
    assert first_adapter_layer(model) == frozen
    if frozen == 0:
        return  # adapters on every layer: nothing is shared, the ordinary path runs
    rollout = vary_lengths(sample(model, tokenizer, tok, n_prompts=2, G=4, max_new=6, seed=4), tok.pad_id)
    rollout.temperature_B = torch.linspace(0.6, 1.4, 8)
    model.to(dtype)
    set_prompt_sharing(model, False)  # the separate passes run every row's prompt (tests/test_shared_prompts.py)
    tol = TOLERANCES[dtype]
    prefix = FrozenPrefix(model, rollout, frozen, micro_batch_size=3)  # computed in other micro-batches than used
    index = torch.tensor([1, 3, 4, 6])  # rows from both prompts: a different trimming than any prefix micro-batch
    micro = trim(rollout.select(index))
    mask = micro.completion_mask_BTc.bool()
    weights = torch.randn(micro.completion_ids_BTc.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    full_logp, full_grads = logp_and_grads(model, micro, weights)
    shared_logp, shared_grads = logp_and_grads(model, micro, weights, prefix.rows(index, micro))
    assert (shared_logp[mask] - full_logp[mask]).abs().max() <= tol["logp"]
    assert torch.allclose(shared_grads, full_grads, atol=tol["grad_atol"], rtol=tol["grad_rtol"]), \
        (shared_grads - full_grads).abs().max()
    assert full_grads.abs().max() > 0
    with torch.no_grad(), reference_policy(model):
        ref_full, _ = completion_logprobs(model, micro)
        ref_shared, _ = completion_logprobs(model, micro, prefix=prefix.rows(index, micro))
    assert (ref_shared[mask] - ref_full[mask]).abs().max() <= tol["logp"]
    assert (ref_full[mask] - full_logp[mask]).abs().max() > 1e-3  # the adapter matters above the prefix


def test_adapter_only_on_the_head_shares_every_layer(four_layer_models):
    tokenizer, tok, model = make_policy(four_layer_models["llama"], target_modules=["lm_head"])
    perturb_adapter(model, scale=0.3)
    assert first_adapter_layer(model) == 4
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=5), tok.pad_id)
    model.to(torch.float64)  # the prefix and the full pass trim the rows differently: float32 rounds them apart
    prefix = FrozenPrefix(model, rollout, 4, micro_batch_size=8)
    micro = trim(rollout.select(slice(0, 8)))
    mask = micro.completion_mask_BTc.bool()
    with torch.no_grad():
        full, _ = completion_logprobs(model, micro)
        shared, _ = completion_logprobs(model, micro, prefix=prefix.rows(slice(0, 8), micro))
    assert (shared[mask] - full[mask]).abs().max() <= 1e-12


def test_lora_on_the_embeddings_shares_nothing(four_layer_models):
    _, _, model = make_policy(four_layer_models["llama"], target_modules=["embed_tokens", "q_proj"], layers=None)
    assert first_adapter_layer(model) == 0


def run_training(tiny_model_dir, prompts_file, out, share, monkeypatch):
    """-> (adapter tensors, metrics, number of prefixes computed: one per step when sharing)."""
    import json

    import rlora.models.frozen_prefix as prefix_module
    from conftest import tiny_overrides
    from rlora.cli import main
    from safetensors.torch import load_file

    built = []

    class CountedPrefix(FrozenPrefix):
        def __init__(self, *args):
            super().__init__(*args)
            built.append(self.num_frozen)

    monkeypatch.setattr(prefix_module, "FrozenPrefix", CountedPrefix)  # what the step's frozen_prefix builds

    overrides = tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "lora.top_layers": 1, "algo.beta": 0.04, "algo.num_iterations": 2, "train.share_frozen_layers": share,
        "eval.before": "false", "eval.after": "false", "train.micro_batch_size": 2})
    assert main(["train", *overrides]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(out / "adapter" / "adapter_model.safetensors")), metrics, built


def test_training_with_shared_layers_equals_training_without(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """2 steps with beta > 0 and two updates per rollout (reference, old and 2 policy passes reuse the
    prefix): the same adapter and the same logged losses as without sharing."""
    shared, shared_metrics, shared_built = run_training(tiny_model_dir, prompts_file, tmp_path / "shared", "true",
                                                        monkeypatch)
    plain, plain_metrics, plain_built = run_training(tiny_model_dir, prompts_file, tmp_path / "plain", "false",
                                                     monkeypatch)
    assert shared_built == [1, 1] and plain_built == []  # one prefix (the lower of 2 layers) per step, or none
    assert set(shared) == set(plain) and all(".layers.1." in name for name in shared)  # top layer only
    assert max((shared[k] - plain[k]).abs().max().item() for k in shared) <= 1e-6
    assert any(shared[k].abs().max() > 0 for k in shared if "lora_B" in k)  # training changed the adapter
    for a, b in zip(shared_metrics, plain_metrics):
        for key in ("loss", "kl", "reward_mean", "ratio_mean"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert all("prefix_s" in m for m in shared_metrics)


def test_top_layers_choice_is_checked(tiny_model_dir, prompts_file, tmp_path, capsys):
    from conftest import tiny_overrides
    from rlora.cli import main

    both = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "a"), **{"lora.top_layers": 1, "lora.layers": "[1]"})
    assert main(["train", *both]) == 2 and "not both" in capsys.readouterr().err
    too_many = tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "b"), **{"lora.top_layers": 3})
    assert main(["train", *too_many]) == 2 and "exceeds the model's 2 decoder layers" in capsys.readouterr().err
