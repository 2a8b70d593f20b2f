"""The decode loop (rollout/decode_loop.py): what it records per token by hand; continuous batching (slots that
take the next prompt when their rows finish) samples what one slot per prompt samples, token for token, in the
row-dropping host loop and in the fixed-shape step with the draw inside it; the fixed-shape loop reads back
to the host once every CHECK_EVERY steps or when a slot reaches its max_new_tokens, not every token."""

import pytest
import torch
from test_engine import policy

from rlora.rollout import decode_loop, graphed
from rlora.rollout.decode_loop import CHECK_EVERY, RowsOnDevice
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams

EOS, PAD = 7, 0


def test_record_ends_rows_at_eos_or_their_own_limit():
    """Three rows, max_new 4, own limits 4, 2, 4; EOS (7) drawn by row 0 at t = 1 and by row 2 at t = 3. A
    finished row's entries stay as they are when a later (ignored) draw is recorded past its end."""
    rows = RowsOnDevice.empty(3, 4, PAD, "cpu")
    eos_V = torch.zeros(10, dtype=torch.bool)
    eos_V[EOS] = True
    max_new_B = torch.tensor([4, 2, 4])
    drawn = [[3, 5, 6], [EOS, 4, 2], [8, 9, 1], [1, 1, EOS], [2, 2, 2]]  # token t of rows 0, 1, 2
    for t, tokens in enumerate(drawn):
        rows.record(torch.arange(3), torch.tensor(tokens), torch.tensor([-0.5, -1.0, -2.0]) - t, torch.full((3,), t),
                    eos_V, max_new_B)
    assert rows.tokens_BT.tolist() == [[3, EOS, PAD, PAD], [5, 4, PAD, PAD], [6, 2, 1, EOS]]
    assert rows.length_B.tolist() == [2, 2, 4]
    assert rows.stopped_B.tolist() == [True, False, True]  # row 1 ended at its limit, not at EOS
    assert rows.done_B.all()
    assert rows.logp_BT.tolist() == [[-0.5, -1.5, 0, 0], [-1.0, -2.0, 0, 0], [-2.0, -3.0, -4.0, -5.0]]
    rows.record(torch.tensor([2, 0]), torch.tensor([9, 9]), torch.tensor([-9.0, -9.0]), torch.tensor([1, 0]), eos_V,
                torch.tensor([4, 4]))  # rows at different steps, both finished: nothing changes
    assert rows.tokens_BT[2, 1] == 2 and rows.tokens_BT[0, 0] == 3


def _per_prompt():
    """No top-k/top-p/min-p: in the fixed-shape loop the draw runs inside the step. Temperatures differ per
    prompt, prompt 1 is greedy, prompt 2 may not end before 5 tokens (its EOS banned until then), limits are
    ragged, so slots finish at different steps."""
    return [SamplingParams(max_new_tokens=14, temperature=0.7), SamplingParams(max_new_tokens=9, greedy=True),
            SamplingParams(max_new_tokens=12, temperature=1.3, min_new_tokens=5),
            SamplingParams(max_new_tokens=20, temperature=1.0), SamplingParams(max_new_tokens=3, temperature=0.9),
            SamplingParams(max_new_tokens=17, temperature=1.1)]


def _prompts(prompts):
    return prompts + prompts[:2]  # six prompts


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("merge", [True, False])
def test_slots_refilled_as_rows_finish_sample_what_one_slot_per_prompt_samples(tiny_model_dir, decode, merge):
    """Six prompts x 3 rows through 2 or 3 slots (continuous), 2 slots in fixed chunks, and 6 slots (no refill),
    against the eager loop with a slot per prompt: the same tokens, reasons and log-probs."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    prompts = _prompts(prompts)
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 3, _per_prompt(), seed=11)
    eos = int(free.completion_ids_BTc[0, 2])  # declared EOS: rows end wherever they draw it

    def sample(max_rows, mode, continuous=True):
        return BuiltinGenerator(tokenizer, [eos], tok.pad_id, merge=merge, decode=mode, max_rows=max_rows,
                                continuous=continuous).sample(model, prompts, 3, _per_prompt(), seed=11)

    want = sample(18, "eager")
    lengths = want.completion_mask_BTc.sum(-1)
    assert len(set(lengths.tolist())) > 3 and "stop" in want.finish_reasons, "rows must end at different steps"
    assert int(lengths[6:9].min()) >= 5, "prompt 2's rows may not end before min_new_tokens"
    for got in (sample(6, decode), sample(9, decode), sample(6, decode, continuous=False), sample(18, decode)):
        assert torch.equal(want.completion_ids_BTc, got.completion_ids_BTc)
        assert torch.equal(want.completion_mask_BTc, got.completion_mask_BTc)
        assert want.finish_reasons == got.finish_reasons
        assert (want.sampling_logp_BTc - got.sampling_logp_BTc).abs().max() < 1e-5


def test_a_slot_takes_the_next_prompt_while_others_still_decode(tiny_model_dir, monkeypatch):
    """With 2 slots, the prompt after a short one starts while the long one is still running (continuous), and
    only after both have finished in fixed chunks."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    settings = [SamplingParams(max_new_tokens=n, min_new_tokens=n) for n in (20, 3, 4, 5)]
    placed = []
    real_place = decode_loop.Slots.place

    def place(self, slots, prompts_n, prompt_len_n):
        placed.append((list(prompts_n), self.t_S.tolist()))  # the slots' steps when these prompts come in
        return real_place(self, slots, prompts_n, prompt_len_n)

    monkeypatch.setattr(decode_loop.Slots, "place", place)
    for continuous in (True, False):
        placed.clear()
        BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, max_rows=2, decode="static", continuous=continuous).sample(
            model, prompts, 1, settings, seed=0)
        # (every slot's step moves on each step, a finished slot's too, up to the last cache position, 19)
        if continuous:  # prompt 2 comes into slot 1 when prompt 1 (3 tokens: 2 steps) ends, prompt 0 at step 2 of 19
            assert placed[0][0] == [0, 1] and placed[1] == ([2], [2, 2]) and placed[2][0] == [3]
            assert placed[2][1][0] < 18  # prompt 3 also starts while prompt 0 still decodes
        else:  # prompts 2 and 3 together, after prompt 0's 20 tokens (19 steps)
            assert [p for p, _ in placed] == [[0, 1], [2, 3]] and placed[1][1][0] == 19


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_continued_rows_keep_the_same_caches_in_any_slot(tiny_model_dir, decode):
    """sample_continued (multi-turn): the caches rows leave are the same through 2 slots as through one per prompt
    in the eager loop, while rows end early (a third of the vocabulary ends a row: the fixed-shape step keeps
    feeding a finished slot, which must never land on a position a row keeps); a second turn continued from them,
    each row's new tokens the longer the shorter its past (admitted together, the prompt part needs the longest
    past plus the longest turn), samples what each row continued alone samples."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    eos = list(range(0, len(tokenizer), 3))
    settings = [SamplingParams(max_new_tokens=n, temperature=1.0) for n in (9, 4, 6, 12)]
    outs = []
    for mode, max_rows in (("eager", 8), (decode, 2), (decode, 8)):
        engine = BuiltinGenerator(tokenizer, eos, tok.pad_id, max_rows=max_rows, decode=mode)
        first, caches = engine.sample_continued(model, prompts, 2, settings, seed=1)
        order = sorted(range(len(caches)), key=lambda i: caches[i].length)
        turn = [None] * len(caches)
        for rank, i in enumerate(order):  # the shortest past gets the longest turn
            turn[i] = list(range(10, 10 + 2 * (len(caches) - rank)))
        params = SamplingParams(max_new_tokens=5, temperature=1.0)
        second, _ = engine.sample_continued(model, turn, 1, params, seed=2, past=caches)
        alone = [BuiltinGenerator(tokenizer, eos, tok.pad_id, max_rows=1).sample_continued(
            model, [turn[i]], 1, params, seed=2, keys=[i], past=[caches[i]])[0] for i in range(len(caches))]
        outs.append((first, caches, second, alone))
    lengths = outs[0][0].completion_mask_BTc.sum(-1)
    assert lengths.min() < 4 and len(set(lengths.tolist())) > 2  # rows ended early, at different steps
    reference = outs[0]
    for first, caches, second, alone in outs:
        assert torch.equal(first.completion_ids_BTc, reference[0].completion_ids_BTc)
        for x, y in zip(caches, reference[1]):
            for (kx, vx), (ky, vy) in zip(x.layers, y.layers):
                assert kx.shape == ky.shape and (kx - ky).abs().max() < 1e-5 and (vx - vy).abs().max() < 1e-5
        assert torch.equal(second.completion_ids_BTc, reference[2].completion_ids_BTc)
        for i, one in enumerate(alone):
            width = int(one.completion_mask_BTc.sum())
            assert one.completion_ids_BTc[0, :width].tolist() == second.completion_ids_BTc[i, :width].tolist()
            torch.testing.assert_close(one.sampling_logp_BTc[0, :width], second.sampling_logp_BTc[i, :width],
                                       rtol=0, atol=1e-5)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_slots_whose_rows_all_end_at_their_first_token_are_refilled(tiny_model_dir, decode):
    """max_new_tokens 1: every row ends at the token drawn after its prefill, so each refill leaves no live row;
    the loop refills again instead of stepping no row, and samples what a slot per prompt samples."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    params = SamplingParams(max_new_tokens=1, temperature=1.0)
    one_each = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, max_rows=8).sample(model, prompts, 2, params, seed=0)
    two_slots = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, max_rows=2, decode=decode).sample(
        model, prompts, 2, params, seed=0)
    assert two_slots.completion_ids_BTc.shape == (8, 1)
    assert torch.equal(two_slots.completion_ids_BTc, one_each.completion_ids_BTc)


def test_the_loop_reads_back_once_every_check_and_when_a_slot_reaches_its_limit(tiny_model_dir, monkeypatch):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    reads, steps = [], []
    real_finished = decode_loop.all_finished
    monkeypatch.setattr(decode_loop, "all_finished", lambda done: reads.append(1) or real_finished(done))
    real_call = graphed.StaticDecoder.__call__
    monkeypatch.setattr(graphed.StaticDecoder, "__call__",
                        lambda self, tokens, positions, t_S: steps.append(1) or real_call(self, tokens, positions, t_S))
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode="static").sample(model, prompts, 2, params, seed=3)
    assert free.completion_mask_BTc.sum(-1).min() == 40  # nothing ends early: 39 steps, reads at 8, ..., 32, 39
    assert len(steps) == 39 and len(reads) == 39 // CHECK_EVERY + 1
    reads.clear(), steps.clear()
    half = list(range(0, len(tokenizer), 2))  # every even token id ends a row: rows end after a few tokens
    ended = BuiltinGenerator(tokenizer, half, tok.pad_id, decode="static").sample(model, prompts, 2, params, seed=3)
    last_end = int(ended.completion_mask_BTc.sum(-1).max())
    assert last_end < 40 - CHECK_EVERY, "every row must end early"
    assert last_end - 1 <= len(steps) < last_end - 1 + CHECK_EVERY  # it stops at the first read after the end
    assert len(reads) == len(steps) // CHECK_EVERY
