"""A packed pass's attention by the layout's structure (models/packed_attention.py) against sdpa over the whole
packed sequences with the dense mask (models/packed_groups.py packed_attention_mask), in float64: outputs and
gradients at every position a real token reads; and how it plugs into transformers' attention dispatch."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rlora.batching import trim
from rlora.models import packed_attention
from rlora.models.logprobs import completion_hidden, completion_logprobs
from rlora.models.packed_attention import STRUCTURED_ATTENTION, plan_structured_attention, structured_attention
from rlora.models.packed_groups import (
    _PAD, cheapest_capacity, packed_attention_mask, packed_layout, plan_packing, structured_cost,
)
from rlora.models.loading import causal_lm
from rlora.models.precision import trainer_precision
from rlora.models.shared_prompts import prompt_groups, set_prompt_sharing
from test_shared_prompts import _policy, _rollout


def _structured_and_dense(inverse, lengths, prompt_mask_UT, capacity=None, heads=4, kv_heads=2, d=8, seed=0):
    """Random q/k/v at the packed positions of a layout -> (structured outputs, dense outputs, which positions hold
    a real token (a real prompt token or a completion token), the gradients of q/k/v of either under one loss)."""
    num_prompts, Tp = prompt_mask_UT.shape
    layout = packed_layout(inverse, lengths, num_prompts, Tp, torch.device("cpu"), capacity)
    S, Ns = layout.owner_SN.shape
    prompt_mask_ST = prompt_mask_UT[layout.prompt_S]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(S, h, Ns, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    weights = torch.randn(S, Ns, heads, d, generator=g, dtype=torch.float64)
    real_SN = (layout.owner_SN >= 0) | (torch.nn.functional.pad(prompt_mask_ST.bool(), (0, Ns - Tp)))
    plan = plan_structured_attention(prompt_mask_ST, list(layout.sequence_B), layout.token_seq_N,
                                     layout.token_slot_N, layout.token_row_N, layout.token_t_N, Ns, layout.longest,
                                     torch.float64)
    scale = 0.3

    def run(structured: bool):
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
        if structured:
            out, weights_out = packed_attention._packed_attention(nn.Module(), qs, ks, vs, None, scaling=scale,
                                                                  rlora_packed=plan)
            assert weights_out is None
        else:
            bias = torch.zeros(S, 1, Ns, Ns, dtype=torch.float64).masked_fill(
                ~packed_attention_mask(layout.owner_SN, prompt_mask_ST), torch.finfo(torch.float64).min)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, scale=scale,
                                                 enable_gqa=True).transpose(1, 2)
        (out * weights)[real_SN].sum().backward()  # a loss that reads what the real tokens' outputs feed
        return out.detach(), (qs.grad, ks.grad, vs.grad)

    (out, grads), (ref, grads_ref) = run(True), run(False)
    return out, ref, real_SN, layout, grads, grads_ref


@pytest.mark.parametrize("repeat_kv", [False, True])
@pytest.mark.parametrize("capacity", [None, 3])
def test_structured_attention_equals_the_dense_mask_at_real_tokens(capacity, repeat_kv, monkeypatch):
    """Rows 0..4 on prompts [1, 0, 0, 1, 0], completion lengths [2, 0, 3, 1, 1] (a row without tokens), prompts of
    3 positions, the second with one of left padding; 4 query heads on 2 key/value heads (sdpa's enable_gqa, or
    the heads repeated as on a GPU). Capacity 3: prompt 0's rows in two bins (3 and 1 tokens), each headed by a copy
    of the prompt."""
    monkeypatch.setattr(packed_attention, "_gqa_with_a_mask_is_fast", lambda device: not repeat_kv)
    prompt_mask_UT = torch.tensor([[1, 1, 1], [0, 1, 1]])
    out, ref, real_SN, layout, grads, grads_ref = _structured_and_dense(
        [1, 0, 0, 1, 0], [2, 0, 3, 1, 1], prompt_mask_UT, capacity)
    assert len(layout.prompt_S) == (2 if capacity is None else 3)
    assert torch.allclose(out[real_SN], ref[real_SN], atol=1e-12, rtol=0)
    assert float(out[~real_SN & (layout.owner_SN == _PAD)].abs().max()) == 0.0  # positions after a sequence's end
    for grad, grad_ref in zip(grads, grads_ref):
        assert torch.allclose(grad, grad_ref, atol=1e-12, rtol=0)
    # the prompt's left padding and the positions after a sequence's end get no gradient on either side
    assert float(grads[1].transpose(1, 2)[~real_SN].abs().max()) == 0.0


def test_structured_attention_on_a_random_ragged_batch():
    """3 prompts of 6 positions (left padding 0-2), 5 rows each with lengths 0-9, one kv head for 3 query heads."""
    g = torch.Generator().manual_seed(3)
    inverse = torch.randint(0, 3, (15,), generator=g).tolist()
    lengths = torch.randint(0, 10, (15,), generator=g).tolist()
    prompt_mask_UT = (torch.arange(6)[None] >= torch.tensor([[0], [1], [2]])).long()
    out, ref, real_SN, _, grads, grads_ref = _structured_and_dense(inverse, lengths, prompt_mask_UT, heads=3,
                                                                   kv_heads=1)
    assert torch.allclose(out[real_SN], ref[real_SN], atol=1e-12, rtol=0)
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(grads, grads_ref))


def count_structured_calls(monkeypatch) -> list:
    """A list that grows by one at every call of the structured attention (for the rest of the test)."""
    calls = []
    inner = ALL_ATTENTION_FUNCTIONS[STRUCTURED_ATTENTION]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, STRUCTURED_ATTENTION,
                        lambda *args, **kwargs: calls.append(1) or inner(*args, **kwargs))
    return calls


def test_the_packed_pass_attends_by_structure_and_restores_the_models_attention(tiny_model_dir, monkeypatch):
    """The model's packed pass calls the structured attention once per layer; afterwards (and after an error inside
    a pass) the model's configured attention is back; the function refuses a call outside a packed pass."""
    model = _policy(tiny_model_dir, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    assert plan_packing(model, batch, prompt_groups(batch)).structured
    calls = count_structured_calls(monkeypatch)
    hf = causal_lm(model)
    completion_hidden(model, batch)
    assert len(calls) == len(hf.get_decoder().layers) and hf.config._attn_implementation == "sdpa"
    with pytest.raises(KeyError), structured_attention(hf):
        assert hf.config._attn_implementation == STRUCTURED_ATTENTION
        raise KeyError("inside")
    assert hf.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="only inside rlora's packed passes"), structured_attention(hf), \
            torch.no_grad():
        hf(input_ids=batch.prompt_ids_BTp)


def test_the_structured_cost_by_hand():
    """2 prompts of 4 positions, rows [3, 1] and [2, 2]: one sequence each of 4 + 4 positions; pairs: the prompts
    2 x 4^2, the 4 rows each 3 x (4 + 3) (padded to the longest completion)."""
    assert structured_cost(2, 8, 4, 4, 3, 10.0, 1.0) == 2 * 8 * 10.0 + (2 * 16 + 4 * 3 * 7) * 1.0
    # rows [40, 40, 40, 20] on each of 2 prompts (Tp 4), attention 100x a token's linear maps per pair: structured,
    # the bins change only the linear maps and the prompt copies, so one sequence per prompt (capacity 160, 2 x 144
    # positions against 4 + 4 + 8 x 40 = 328 unpacked) is the cheapest, and it pays; with the dense mask every bin
    # costs its Ns^2 pairs, more than the padding saves, at any capacity
    args = ([0] * 4 + [1] * 4, [40, 40, 40, 20] * 2, 2, 4, 40, 1.0, 100.0)
    assert cheapest_capacity(*args, structured=True) == 160
    assert cheapest_capacity(*args, structured=False) is None


def test_half_precision_attends_in_float32_on_a_cpu():
    """bf16 q/k/v (a bf16 model, or autocast) on a CPU: the plan's masks are float32, the attention runs on the
    inputs cast to float32 (even under autocast, which would cast them back) and returns the model's dtype: exactly
    float32 attention of the same values, rounded once."""
    layout = packed_layout([1, 0, 0, 1, 0], [2, 0, 3, 1, 1], 2, 3, torch.device("cpu"))
    prompt_mask_ST = torch.tensor([[1, 1, 1], [0, 1, 1]])[layout.prompt_S]
    S, Ns = layout.owner_SN.shape
    plan = plan_structured_attention(prompt_mask_ST, list(layout.sequence_B), layout.token_seq_N,
                                     layout.token_slot_N, layout.token_row_N, layout.token_t_N, Ns, layout.longest,
                                     torch.bfloat16)
    assert plan.prompt_bias_S1PP.dtype == plan.row_bias_B1LK.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, h, Ns, 8, generator=g).bfloat16() for h in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half, _ = packed_attention._packed_attention(nn.Module(), q, k, v, None, scaling=0.3, rlora_packed=plan)
    full, _ = packed_attention._packed_attention(nn.Module(), q.float(), k.float(), v.float(), None, scaling=0.3,
                                                 rlora_packed=plan)
    assert half.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(half, full.bfloat16())


def test_a_float32_model_under_bf16_autocast_packs(tiny_model_dir):
    """Under autocast a layer's q and k leave the rotary in float32 while v is a bf16 product: the packed pass takes
    the mix, and its log-probs agree with the unshared pass under the same autocast to bf16 rounding (the unshared
    pass's attention runs in bf16, the packed one's in float32: seen 2.0e-3 apart on log-probs down to -6.4, the
    unshared one 3.3e-3 from the float32 model's without autocast)."""
    model = _policy(tiny_model_dir, torch.float32, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    assert plan_packing(model, batch, prompt_groups(batch)).structured
    mask = batch.completion_mask_BTc.bool()
    with torch.no_grad(), trainer_precision(model, "bfloat16"):
        packed = completion_logprobs(model, batch)[0]
        set_prompt_sharing(model, False)
        unshared = completion_logprobs(model, batch)[0]
        set_prompt_sharing(model, True)
    assert torch.allclose(packed[mask], unshared[mask], atol=1e-2, rtol=0), (packed - unshared)[mask].abs().max()


def test_each_sub_config_gets_its_own_attention_back():
    """transformers' setter writes a config's value into its sub-configs too; after a packed call each config holds
    what it held before (a composite config whose vision part attends eagerly and whose text part with sdpa)."""
    from transformers import Gemma3Config

    config = Gemma3Config()
    config.vision_config._attn_implementation = "eager"
    config.text_config._attn_implementation = "sdpa"
    config._attn_implementation_internal = "sdpa"
    decoder = nn.Module()
    decoder.config = config
    hf = nn.Module()
    hf.get_decoder = lambda: decoder
    with structured_attention(hf):
        assert config._attn_implementation == config.text_config._attn_implementation == STRUCTURED_ATTENTION
    assert config._attn_implementation == "sdpa" and config.text_config._attn_implementation == "sdpa"
    assert config.vision_config._attn_implementation == "eager"
