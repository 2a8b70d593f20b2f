"""A group's prompt computed once in the log-prob passes (models/shared_prompts.py) against the unshared pass:
the same hidden states (float64 to 1e-12), log-probs and gradients (to float32's resolution: transformers
computes RMSNorm, and rlora the log-softmax, in float32 for a float64 model), prompts of different lengths (left
padding), rows of one prompt not next to each other, ragged completions; and where sharing must not happen."""

from dataclasses import fields

import pytest
import torch

from rlora.batching import trim
from rlora.config import LoraConfig
from rlora.models.loading import attach_lora, causal_lm, load_tokenizer
from rlora.models.logprobs import completion_hidden, completion_logprobs
from rlora.models.packed_groups import set_group_packing
from rlora.models.shared_prompts import PromptRows, prompt_groups, set_prompt_sharing, sharing_prompts_unsupported
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams
from test_adapters import base_model, with_random_up_factors


def _policy(model_dir, dtype=torch.float64, dropout=0.0, pack=False):
    """pack=False: the shared prompts' own path (a key/value cache), not the packed groups built on them
    (tests/test_packed_groups.py)."""
    model = attach_lora(base_model(model_dir), LoraConfig(rank=4, alpha=8, dropout=dropout))
    set_group_packing(model, pack)
    return with_random_up_factors(model.to(dtype), "lora_B")


def _rollout(model, model_dir, G=3):
    """Two prompts of different lengths, G ragged completions each, then the rows shuffled so that rows of one
    prompt are not next to each other."""
    tokenizer, tok = load_tokenizer(model_dir)
    prompts = [tokenizer("What is 1 + 1?")["input_ids"], tokenizer("Add twelve and thirty, please, now:")["input_ids"]]
    rollout = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(
        model, prompts, G, SamplingParams(max_new_tokens=6, temperature=1.0), 3)
    for row, length in enumerate([6, 2, 5, 1, 6, 3][:2 * G]):  # ragged, as if EOS had been drawn
        rollout.completion_mask_BTc[row, length:] = 0
    return rollout.select(torch.tensor([4, 0, 2, 5, 1, 3][:2 * G]))


def _both(model, run):
    """run() with prompts shared, then without -> (shared, unshared)."""
    set_prompt_sharing(model, True)
    shared = run()
    set_prompt_sharing(model, False)
    try:
        return shared, run()
    finally:
        set_prompt_sharing(model, True)


def test_prompt_groups_find_rows_of_one_prompt(tiny_model_dir):
    model = _policy(tiny_model_dir)
    batch = _rollout(model, tiny_model_dir)
    first_U, inverse_B = prompt_groups(batch)
    assert len(first_U) == 2  # two prompts, three rows each
    for b in range(6):  # a row's group starts at a row with its very prompt, and it is that group's first row
        first = first_U[inverse_B[b]]
        assert torch.equal(batch.prompt_ids_BTp[b], batch.prompt_ids_BTp[first]) and first <= b
    assert sorted(inverse_B.tolist()) == [0, 0, 0, 1, 1, 1]
    two = [int(first_U[0]), int(first_U[1])]  # two rows, two prompts: nothing to share
    assert prompt_groups(_rows(batch, torch.tensor(two))) is None


def _rows(batch, index):
    return type(batch)(*(None if v is None else v[index] for v in (getattr(batch, f.name) for f in fields(batch))))


def _gradients(model, params, loss) -> list[torch.Tensor]:
    for p in params:
        p.grad = None
    loss().backward()
    return [p.grad.clone() for p in params]


def test_prompt_rows_copy_each_prompt_and_sum_its_rows_gradients_in_one_reduction():
    """Rows of three prompts, unevenly many and interleaved: the forward is x_U[inverse_B] exactly; each prompt's
    gradient is its rows' gradients summed by one reduction in row order (bit for bit `grads[rows].sum(0)`), not
    accumulated into repeated indices (whose order, with several CPU threads, varied between runs)."""
    g = torch.Generator().manual_seed(0)
    for inverse_B in (torch.tensor([2, 0, 0, 1, 2, 0, 2, 2]), torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])):  # also grouped
        x_U = torch.randn(3, 4, 5, generator=g, requires_grad=True)
        rows = PromptRows(inverse_B, 3)
        out_B = rows(x_U)
        assert torch.equal(out_B, x_U[inverse_B])
        grad_B = torch.randn(out_B.shape, generator=g)
        out_B.backward(grad_B)
        for u in range(3):
            assert torch.equal(x_U.grad[u], grad_B[inverse_B == u].sum(0))


@pytest.mark.parametrize("train_mode", [False, True])
def test_shared_prompts_give_the_unshared_hidden_states_and_gradients(tiny_model_dir, train_mode):
    """A float64 model: the hidden states agree to 1e-12. The gradients agree to float32's resolution relative to
    the largest one: transformers' RMSNorm computes in float32 whatever the model's dtype, and its backward sums
    over rows and positions in float32, in another order when the prompt runs once."""
    model = _policy(tiny_model_dir)
    batch = trim(_rollout(model, tiny_model_dir))
    model.train(train_mode)
    assert sharing_prompts_unsupported(model) is None
    mask = batch.completion_mask_BTc.bool()
    (hidden, grads), (hidden_ref, grads_ref) = _both(model, lambda: hidden_and_gradients(model, batch))
    assert torch.allclose(hidden[mask], hidden_ref[mask], atol=1e-12, rtol=0)
    scale = max(float(g.abs().max()) for g in grads_ref)
    assert all(torch.allclose(g, r, atol=1e-6 * scale, rtol=0) for g, r in zip(grads, grads_ref))
    assert min(float(g.abs().max()) for g in grads) > 1e-3  # every adapter matrix gets a gradient


def test_shared_prompts_give_the_unshared_logprobs_and_their_gradients(tiny_model_dir):
    """The log-probs: their log-softmax runs in float32 (models/logprobs.py token_logprobs), so hidden states that
    differ in the last float64 bit may round apart there; float32's resolution (relative to the largest
    gradient) is the tolerance, as for the hidden states' gradients."""
    model = _policy(tiny_model_dir)
    batch = trim(_rollout(model, tiny_model_dir))
    assert_same_logprobs_and_gradients(*_both(model, lambda: logprobs_and_gradients(model, batch)),
                                       batch.completion_mask_BTc.bool())


def hidden_and_gradients(model, batch):
    """-> (the completion hidden states, the adapter's gradients of a fixed random projection of them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    mask = batch.completion_mask_BTc.bool()
    weights_NH = torch.randn(int(mask.sum()), causal_lm(model).config.hidden_size, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(0))
    hidden_BTH = completion_hidden(model, batch)
    grads = _gradients(model, params, lambda: (completion_hidden(model, batch)[mask] * weights_NH).sum())
    return hidden_BTH.detach(), grads


def logprobs_and_gradients(model, batch):
    """-> (log-probs, entropies, the adapter's gradients of a weighted sum of the log-probs), chunked by 5."""
    params = [p for p in model.parameters() if p.requires_grad]
    logp_BT, entropy_BT = completion_logprobs(model, batch, with_entropy=True, chunk_tokens=5)
    weights_BT = torch.linspace(0.5, 1.5, logp_BT.numel()).view_as(logp_BT).double()
    grads = _gradients(model, params, lambda: (completion_logprobs(model, batch, chunk_tokens=5)[0] * weights_BT).sum())
    return logp_BT.detach(), entropy_BT.detach(), grads


def assert_same_logprobs_and_gradients(result, reference, mask_BT):
    """Log-probs and entropies to 1e-6, gradients to float32's resolution relative to the largest."""
    (logp, entropy, grads), (logp_ref, entropy_ref, grads_ref) = result, reference
    assert mask_BT.sum() > 0 and torch.allclose(logp[mask_BT], logp_ref[mask_BT], atol=1e-6, rtol=0)
    assert torch.allclose(entropy[mask_BT], entropy_ref[mask_BT], atol=1e-6, rtol=0)
    scale = max(float(g.abs().max()) for g in grads_ref)
    assert all(torch.allclose(g, r, atol=1e-6 * scale, rtol=0) for g, r in zip(grads, grads_ref))


def test_the_hidden_states_a_value_head_reads_are_the_unshared_ones(tiny_model_dir):
    model = _policy(tiny_model_dir)
    batch = trim(_rollout(model, tiny_model_dir))
    with torch.no_grad():
        shared, unshared = _both(model, lambda: completion_hidden(model, batch))
    assert shared.shape == unshared.shape
    mask = batch.completion_mask_BTc.bool()
    assert torch.allclose(shared[mask], unshared[mask], atol=1e-12, rtol=0)


def test_float32_agrees_to_rounding(tiny_model_dir):
    """float32: the distinct prompts run as a smaller batch, so the matrix products round differently."""
    model = _policy(tiny_model_dir, torch.float32)
    batch = trim(_rollout(model, tiny_model_dir))
    with torch.no_grad():
        shared, unshared = _both(model, lambda: completion_logprobs(model, batch, chunk_tokens=5)[0])
    assert torch.allclose(shared, unshared, atol=2e-5, rtol=0)


def test_no_sharing_where_it_would_change_the_numbers(tiny_model_dir):
    model = _policy(tiny_model_dir, dropout=0.1)
    model.train()
    assert sharing_prompts_unsupported(model) == "dropout in training"
    model.eval()  # no dropout drawn: the passes without gradient share
    assert sharing_prompts_unsupported(model) is None
    set_prompt_sharing(model, False)
    assert sharing_prompts_unsupported(model) == "train.share_prompts=false"
