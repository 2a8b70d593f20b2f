"""A prompt and its rows' completions packed into one sequence (models/packed_groups.py): the layout and the mask
against hand-worked cases and a naive reference, the arithmetic estimate that decides, and the packed pass against
the unshared one (hidden states, log-probs, gradients; sdpa and eager attention)."""

import pytest
import torch

from rlora.batching import trim
from rlora.models import packed_groups
from rlora.models.logprobs import completion_hidden, completion_logprobs
from rlora.models.packed_groups import (
    MAX_MASK_ELEMENTS, assign_bins, cheapest_capacity, group_packing_unsupported, packed_attention_mask, packed_cost,
    packed_layout, packing_pays, plan_packing, set_group_packing,
)
from rlora.models.loading import causal_lm
from rlora.models.shared_prompts import prompt_cache_unsupported, prompt_groups, set_prompt_sharing
from test_shared_prompts import (
    _policy, _rollout, _rows, assert_same_logprobs_and_gradients, hidden_and_gradients, logprobs_and_gradients,
)


def test_the_layout_puts_each_prompt_first_and_its_rows_completions_after_it_in_row_order():
    """Rows 0..4 on prompts [1, 0, 0, 1, 0], completion lengths [2, 0, 3, 1, 1], prompts of 3 positions.
    Sequence 0: prompt, row 2 (3 tokens), row 4 (1); row 1 has none. Sequence 1: prompt, row 0 (2), row 3 (1)."""
    layout = packed_layout([1, 0, 0, 1, 0], [2, 0, 3, 1, 1], num_prompts=2, prompt_len=3, device=torch.device("cpu"))
    P, X = -1, -2  # prompt, padding
    assert layout.num_positions == 7
    assert layout.owner_SN.tolist() == [[P, P, P, 2, 2, 2, 4], [P, P, P, 0, 0, 3, X]]
    assert layout.token_row_N.tolist() == [0, 0, 2, 2, 2, 3, 4]
    assert layout.token_t_N.tolist() == [0, 1, 0, 1, 2, 0, 0]
    assert layout.token_seq_N.tolist() == [1, 1, 0, 0, 0, 1, 0]
    assert layout.token_slot_N.tolist() == [3, 4, 3, 4, 5, 5, 6]
    # tokens followed by another of their row (a row's last token predicts nothing): row 0's t 0, row 2's t 0 and
    # 1, at flat positions seq x 7 + slot
    assert layout.source_M.tolist() == [1 * 7 + 3, 0 * 7 + 3, 0 * 7 + 4]
    assert layout.target_row_M.tolist() == [0, 2, 2] and layout.target_t_M.tolist() == [0, 0, 1]
    assert layout.sequence_B == (1, 0, 0, 1, 0) and layout.prompt_S.tolist() == [0, 1]


def test_the_mask_lets_a_completion_read_its_prompt_and_itself_only():
    """Against a loop over every (query, key) pair written from the rule; the prompt of sequence 1 has one
    position of left padding."""
    layout = packed_layout([1, 0, 0, 1, 0], [2, 0, 3, 1, 1], num_prompts=2, prompt_len=3, device=torch.device("cpu"))
    prompt_mask_UT = torch.tensor([[1, 1, 1], [0, 1, 1]])
    allowed = packed_attention_mask(layout.owner_SN, prompt_mask_UT)
    assert allowed.shape == (2, 1, 7, 7)
    owner = layout.owner_SN.tolist()
    for u in range(2):
        for q in range(7):
            for k in range(7):
                oq, ok = owner[u][q], owner[u][k]
                real_prompt_key = k < 3 and prompt_mask_UT[u, k] == 1
                real_prompt_query = q < 3 and prompt_mask_UT[u, q] == 1
                expected = (q == k or (real_prompt_key and (oq >= 0 or (real_prompt_query and k <= q)))
                            or (oq >= 0 and oq == ok and k <= q))
                assert bool(allowed[u, 0, q, k]) == expected, (u, q, k)
    assert allowed[1, 0, 0].tolist() == [True] + [False] * 6  # the padding reads only itself


def test_packing_pays_where_padding_costs_more_than_the_extra_attention():
    """Hand-computed per layer. Demo-like: 1 prompt of 46, 8 rows padded to 48, 200 real tokens, a SmolLM2 layer
    (2 x 3.54M per token, 4 x 576 per pair): packed, 246 positions cost 1.74e9 + 0.14e9 (attention) against
    shared prompts' 46 + 8 x 48 positions, 3.04e9 + 0.09e9."""
    def pays(num_positions, prompt_len, rows, completion_len, per_token, per_pair, num_sequences=1, **kwargs):
        cost = packed_cost(num_sequences, num_positions, per_token, per_pair)
        return cost is not None and packing_pays(cost, 1, prompt_len, rows, completion_len, per_token, per_pair,
                                                 **kwargs)

    assert packed_cost(1, 246, 7.08e6, 2304) == 246 * 7.08e6 + 246 ** 2 * 2304
    assert pays(246, 46, 8, 48, 7.08e6, 2304)
    # rows padded to 1000 on a layer where attention is dear (per token 1000, per pair 100); 2000 real tokens:
    # packed 2046 x 1000 + 2046^2 x 100 = 4.21e8 against (46 + 8000) x 1000 + (46^2 + 8 x 1000 x 1046) x 100
    # = 8.45e8: fewer pairs too, so it packs. 6000 real tokens in one sequence: 6046^2 x 100 = 3.66e9: not; in 3
    # sequences of 2046: 1.26e9, still not
    assert pays(2046, 46, 8, 1000, 1000, 100)
    assert not pays(6046, 46, 8, 1000, 1000, 100)
    assert not pays(2046, 46, 8, 1000, 1000, 100, num_sequences=3)
    # where the cache pass may not run (gradient checkpointing, a sharded base) the other pass is unshared: 8 rows of
    # 1046 positions, 8 x 1046 x 1000 + 8 x 1046^2 x 100 = 8.84e8. 2928 packed positions: 2928 x 1000 + 2928^2 x 100
    # = 8.60e8, more than the cache pass's 8.45e8 (not packed there) but less than the unshared pass's (packed)
    assert not pays(2928, 46, 8, 1000, 1000, 100)
    assert pays(2928, 46, 8, 1000, 1000, 100, cache_pass=False)
    assert not pays(6046, 46, 8, 1000, 1000, 100, cache_pass=False)
    # no padding to save (every row as long as the longest): the extra attention alone, never packed
    assert not pays(46 + 8 * 48, 46, 8, 48, 7.08e6, 2304)
    side = int(MAX_MASK_ELEMENTS ** 0.5) + 1  # a mask over the cap is never built, however cheap
    assert packed_cost(1, side, 1e12, 0) is None and packed_cost(1, side - 1, 1e12, 0) is not None


def test_rows_go_into_bins_first_fit_longest_first():
    """Prompt 0's rows 0-3 (lengths 5, 3, 4, 2), prompt 1's rows 4-5 (7, 0). Capacity 7: row 0 opens bin 0 (5),
    row 2 does not fit there (9) and opens bin 1 (4), row 1 fits bin 1 (7), row 3 bin 0 (7); prompt 1 gets bin 2."""
    inverse, lengths = [0, 0, 0, 0, 1, 1], [5, 3, 4, 2, 7, 0]
    assert assign_bins(inverse, lengths, 2, capacity=7) == ([0, 1, 1, 0, 2, 2], [0, 0, 1], [7, 7, 7])
    assert assign_bins(inverse, lengths, 2, capacity=None) == ([0, 0, 0, 0, 1, 1], [0, 1], [14, 7])
    # rows longer than the capacity go alone, a row without tokens into its prompt's first bin however full
    assert assign_bins(inverse, lengths, 2, capacity=3) == ([0, 2, 1, 3, 4, 4], [0, 0, 0, 0, 1], [5, 4, 3, 2, 7])
    assert assign_bins([0, 0, 0], [3, 3, 3], 1, capacity=6) == ([0, 0, 1], [0, 0], [6, 3])  # ties in row order


def test_a_layout_in_bins_heads_each_bin_with_its_prompt():
    """The rows above with capacity 7 and prompts of 2 positions: sequence 0 = prompt 0, row 0 (5), row 3 (2);
    sequence 1 = prompt 0, row 1 (3), row 2 (4); sequence 2 = prompt 1, row 4 (7) (row 5 has no token)."""
    layout = packed_layout([0, 0, 0, 0, 1, 1], [5, 3, 4, 2, 7, 0], num_prompts=2, prompt_len=2,
                           device=torch.device("cpu"), capacity=7)
    P = -1
    assert layout.num_positions == 9
    assert layout.owner_SN.tolist() == [[P, P, 0, 0, 0, 0, 0, 3, 3], [P, P, 1, 1, 1, 2, 2, 2, 2],
                                        [P, P, 4, 4, 4, 4, 4, 4, 4]]
    assert layout.prompt_S.tolist() == [0, 0, 1] and layout.sequence_B == (0, 1, 1, 0, 2, 2)
    assert layout.token_seq_N.tolist() == [0] * 5 + [1] * 3 + [1] * 4 + [0] * 2 + [2] * 7
    assert layout.token_slot_N.tolist() == [2, 3, 4, 5, 6, 2, 3, 4, 5, 6, 7, 8, 7, 8, 2, 3, 4, 5, 6, 7, 8]


def test_the_cheapest_capacity_by_hand():
    """One prompt of 10, rows of 100 and 7 x 10 (padded to 100), per token 1000, per pair 100. Capacity 100: bins
    [100] and [7 x 10], 2 x 110 positions: 2.2e5 + 2 x 110^2 x 100 = 2.64e6; 200 (a whole group): 180 positions,
    1.8e5 + 3.24e6 = 3.42e6; the cache pass (10 + 800) x 1000 + (100 + 800 x 110) x 100 = 9.62e6: bins of 100."""
    inverse, lengths = [0] * 8, [100] + [10] * 7
    assert cheapest_capacity(inverse, lengths, 1, 10, 100, 1000, 100) == 100
    assert cheapest_capacity(inverse, lengths, 1, 10, 100, 1000, 0) == 200  # attention free: fewest positions
    # every row as long as the longest: 8 x 10 tokens in bins of 10 / 20 / 40 / 80 cost 160 / 120 / 100 / 90 x 1000
    # + 3200 / 3600 / 5000 / 8100 x 100, against the cache pass's 90 x 1000 + 1700 x 100: never packed
    assert cheapest_capacity([0] * 8, [10] * 8, 1, 10, 10, 1000, 100) is None
    # a whole group over the mask's cap (11010^2 > 2^26) still packs in bins: [4000], [4 x 1000], [3 x 1000] make
    # 3 x 4010^2 = 4.8e7 pairs; bins of 8000 (2 x 8010^2 = 1.3e8) and the whole group are over it
    big = [4000] + [1000] * 7
    assert cheapest_capacity([0] * 8, big, 1, 10, 4000, 1, 0) == 4000


def _packed_and_unshared(model, run, attention="sdpa"):
    """run() packed under `attention`, and with prompts not shared at all under sdpa -> (packed, unshared). (The
    unshared reference runs under sdpa: transformers' eager attention gives NaN on a float64 model's left-padded
    rows.)"""
    hf = causal_lm(model)
    set_group_packing(model, True)
    set_prompt_sharing(model, False)
    try:
        unshared = run()
        set_prompt_sharing(model, True)
        hf.set_attn_implementation(attention)
        return run(), unshared
    finally:
        set_prompt_sharing(model, True)
        hf.set_attn_implementation("sdpa")


@pytest.mark.parametrize("layout", ["structured", "dense"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_groups_give_the_unshared_hidden_states_and_gradients(tiny_model_dir, monkeypatch, attention, layout):
    """float64: the hidden states agree to 1e-12 (sdpa), the gradients to float32's resolution relative to the
    largest (transformers' RMSNorm sums in float32, in another order when the rows are packed). Both ways of
    attending in a packed pass: by the layout's structure (models/packed_attention.py, the default), and with the
    dense mask (what a pass under gradient checkpointing uses)."""
    if layout == "dense":
        monkeypatch.setattr(packed_groups, "recomputes_forward", lambda model: True)
    model = _policy(tiny_model_dir, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    planned = plan_packing(model, batch, prompt_groups(batch))
    assert planned is not None and planned.structured == (layout == "structured")  # the pass compared is packed
    # eager attention takes its softmax in float32 (transformers), so there float32's resolution on values ~1-2
    hidden, grads = _assert_packed_is_unshared(model, batch, attention, atol=1e-12 if attention == "sdpa" else 1e-6)
    mask = batch.completion_mask_BTc.bool()
    assert float(hidden[:, 1:][~mask[:, 1:]].abs().max()) == 0.0  # padding after position 0 holds zeros
    assert min(float(g.abs().max()) for g in grads) > 1e-3  # every adapter matrix gets a gradient


def _assert_packed_is_unshared(model, batch, attention="sdpa", atol=1e-12):
    """Packed (under `attention`) against unshared: hidden states at real positions to atol, gradients to float32's
    resolution relative to the largest -> the packed (hidden states, gradients)."""
    mask = batch.completion_mask_BTc.bool()
    (hidden, grads), (hidden_ref, grads_ref) = _packed_and_unshared(model, lambda: hidden_and_gradients(model, batch),
                                                                    attention)
    assert torch.allclose(hidden[mask], hidden_ref[mask], atol=atol, rtol=0)
    scale = max(float(g.abs().max()) for g in grads_ref)
    assert all(torch.allclose(g, r, atol=1e-6 * scale, rtol=0) for g, r in zip(grads, grads_ref))
    return hidden, grads


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_rows_in_several_bins_per_prompt_give_the_unshared_hidden_states_and_gradients(tiny_model_dir, monkeypatch,
                                                                                       attention):
    """Bins of 7 completion tokens: each prompt's rows (lengths 6, 5, 2 and 6, 3, 1) fill two bins, one row alone
    and two together; each bin repeats its prompt, whose last state starts its own rows' completions."""
    monkeypatch.setattr(packed_groups, "cheapest_capacity", lambda *args, **kwargs: 7)
    model = _policy(tiny_model_dir, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    layout = plan_packing(model, batch, prompt_groups(batch))
    assert layout.prompt_S.tolist() == [0, 0, 1, 1] and len(set(layout.sequence_B)) == 4
    _assert_packed_is_unshared(model, batch, attention, atol=1e-12 if attention == "sdpa" else 1e-6)


@pytest.mark.parametrize("capacity", [None, 7])
def test_packed_groups_give_the_unshared_logprobs_entropies_and_their_gradients(tiny_model_dir, monkeypatch, capacity):
    if capacity is not None:  # in bins (above); None: what the estimate picks
        monkeypatch.setattr(packed_groups, "cheapest_capacity", lambda *args, **kwargs: capacity)
    model = _policy(tiny_model_dir, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    assert plan_packing(model, batch, prompt_groups(batch)) is not None
    assert_same_logprobs_and_gradients(*_packed_and_unshared(model, lambda: logprobs_and_gradients(model, batch)),
                                       batch.completion_mask_BTc.bool())


def test_float32_agrees_to_rounding(tiny_model_dir):
    """float32: the same tokens in other product shapes round differently (as for shared prompts)."""
    model = _policy(tiny_model_dir, torch.float32, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    with torch.no_grad():
        packed, unshared = _packed_and_unshared(model, lambda: completion_logprobs(model, batch, chunk_tokens=5)[0])
    assert torch.allclose(packed, unshared, atol=2e-5, rtol=0)


def test_no_packing_where_it_is_off_unsupported_or_would_drop_a_token(tiny_model_dir):
    model = _policy(tiny_model_dir, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    groups = prompt_groups(batch)
    assert group_packing_unsupported(model, batch) is None and plan_packing(model, batch, groups) is not None
    holed = batch.completion_mask_BTc.clone()
    row = int(holed.sum(-1).argmax())
    holed[row, 0] = 0  # a token after padding: packing would lose it, so the padded path runs
    assert plan_packing(model, type(batch)(batch.prompt_ids_BTp, batch.prompt_mask_BTp, batch.completion_ids_BTc,
                                           holed, batch.temperature_B), groups) is None
    causal_lm(model).config._attn_implementation = "flash_attention_2"  # reads no 4-D mask
    assert group_packing_unsupported(model, batch) == "attention 'flash_attention_2' takes no custom mask"
    causal_lm(model).config._attn_implementation = "sdpa"
    set_group_packing(model, False)
    assert group_packing_unsupported(model, batch) == "train.pack_groups=false"
    assert plan_packing(model, batch, groups) is None


@pytest.mark.parametrize("capacity", [None, 5])
def test_rows_without_or_with_one_token_and_a_prompt_with_one_row(tiny_model_dir, monkeypatch, capacity):
    """Packing forced (whatever the estimate says): completions of 0 and 1 tokens, one prompt with a single row,
    the other's rows not next to each other; float64 hidden states at real positions and the gradients as
    unshared. Capacity 5: that prompt's rows (0, 5, 1 tokens) in two bins, the row without tokens in the first."""
    monkeypatch.setattr(packed_groups, "packing_pays", lambda *args, **kwargs: True)
    if capacity is not None:
        monkeypatch.setattr(packed_groups, "cheapest_capacity", lambda *args, **kwargs: capacity)
    model = _policy(tiny_model_dir, pack=True)
    batch = _rollout(model, tiny_model_dir)
    groups = prompt_groups(batch)
    first, second = (torch.nonzero(groups[1] == u).flatten().tolist() for u in (0, 1))
    batch = _rows(batch, torch.tensor([first[0], second[0], first[1], first[2]]))  # 3 rows on one prompt, 1 on one
    for row, length in enumerate([0, 1, 5, 1]):
        batch.completion_mask_BTc[row, length:] = 0
    batch = trim(batch)
    layout = plan_packing(model, batch, prompt_groups(batch))
    assert layout is not None and len(layout.prompt_S) == (2 if capacity is None else 3)
    _assert_packed_is_unshared(model, batch)


def _decoder_calls(model, batch, grad: bool = False) -> int:
    calls = []
    handle = causal_lm(model).get_decoder().layers[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        with torch.set_grad_enabled(grad):
            completion_hidden(model, batch)
    finally:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("pays", [True, False])
def test_a_sharded_base_runs_each_layer_once_per_pass(tiny_model_dir, monkeypatch, pays):
    """train.fsdp all-gathers a layer each time it runs, and every rank must run the same passes: there a pass is
    packed or not shared (one call per layer, as a rank's padding passes), never the shared prompts' two calls
    (prompts, then completions), whichever a rank's own rows make the estimate choose."""
    monkeypatch.setattr(packed_groups, "packing_pays", lambda *args, **kwargs: pays)
    model = _policy(tiny_model_dir, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    assert _decoder_calls(model, batch) == (1 if pays else 2)  # unsharded: packed once, or the shared cache's two
    causal_lm(model).rlora_sharded_base = object()  # what train/fsdp.py shard_base leaves on the model
    assert prompt_cache_unsupported(model) == "a sharded base (train.fsdp)"
    assert _decoder_calls(model, batch) == 1


@pytest.mark.parametrize("layout", ["structured", "dense"])
def test_the_masks_are_kept_once_for_the_backward_whatever_the_layers(tiny_model_dir, monkeypatch, layout):
    """The additive masks are built once per pass in the scores' dtype: the layers' attention keeps those tensors for
    the backward (a boolean mask is turned into a new float tensor in every layer by sdpa). Dense: one [S, 1, Ns, Ns]
    mask; structured: the prompts' [S, 1, Tp, Tp] and the rows' [B, 1, L, Tp + L]."""
    if layout == "dense":
        monkeypatch.setattr(packed_groups, "recomputes_forward", lambda model: True)
    model = _policy(tiny_model_dir, pack=True)
    batch = trim(_rollout(model, tiny_model_dir))
    planned = plan_packing(model, batch, prompt_groups(batch))
    Tp, L = batch.prompt_ids_BTp.shape[1], int(batch.completion_mask_BTc.sum(-1).max())
    shapes = [(planned.num_positions, planned.num_positions)] if layout == "dense" else [(Tp, Tp), (L, Tp + L)]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        completion_hidden(model, batch)
    masks = {t.untyped_storage().data_ptr() for t in kept if tuple(t.shape[-2:]) in shapes and t.dim() == 4
             and t.shape[1] == 1 and t.is_floating_point()}
    assert len(causal_lm(model).get_decoder().layers) >= 2 and len(masks) == len(shapes), len(masks)


def test_packed_under_gradient_checkpointing(tiny_model_dir, monkeypatch):
    """Gradient checkpointing turns transformers' key/value cache off (in passes with gradient), so shared
    prompts' cache pass cannot run there; a packed pass needs no cache and gives the unshared gradients; where
    packing does not pay, the pass is unshared (one decoder call)."""
    model = _policy(tiny_model_dir, pack=True)
    causal_lm(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = trim(_rollout(model, tiny_model_dir))
    assert prompt_cache_unsupported(model) == "gradient checkpointing"
    planned = plan_packing(model, batch, prompt_groups(batch))
    assert planned is not None and not planned.structured  # the recomputed forward attends with the model's own
    _assert_packed_is_unshared(model, batch)
    monkeypatch.setattr(packed_groups, "packing_pays", lambda *args, **kwargs: False)
    assert _decoder_calls(model, batch, grad=True) == 1
    assert _decoder_calls(model, batch) == 2  # without gradient nothing is checkpointed: the cache pass may run
