"""The decode loop that keeps the rows' state on the device (rollout/device_loop.py): what it records per
token by hand, that the fixed-shape step with the draw inside it samples what the row-dropping host loop
samples, and that it reads back to the host once every CHECK_EVERY tokens, not every token."""

import pytest
import torch
from test_engine import policy

from rlora.rollout import device_loop
from rlora.rollout.device_loop import CHECK_EVERY, RowsOnDevice
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams

EOS, PAD = 7, 0


def test_record_ends_rows_at_eos_or_their_own_limit():
    """Three rows, max_new 4, own limits 4, 2, 4; EOS (7) drawn by row 0 at t = 1 and by row 2 at t = 3."""
    rows = RowsOnDevice.empty(3, 4, PAD, "cpu")
    eos_V = torch.zeros(10, dtype=torch.bool)
    eos_V[EOS] = True
    max_new_B = torch.tensor([4, 2, 4])
    drawn = [[3, 5, 6], [EOS, 4, 2], [8, 9, 1], [1, 1, EOS]]  # token t of rows 0, 1, 2
    for t, tokens in enumerate(drawn):
        rows.record(torch.tensor(tokens), torch.tensor([-0.5, -1.0, -2.0]) - t, t, eos_V, max_new_B, PAD)
    assert rows.tokens_BT.tolist() == [[3, EOS, PAD, PAD], [5, 4, PAD, PAD], [6, 2, 1, EOS]]
    assert rows.length_B.tolist() == [2, 2, 4]
    assert rows.stopped_B.tolist() == [True, False, True]  # row 1 ended at its limit, not at EOS
    assert rows.done_B.all()
    assert rows.logp_BT.tolist() == [[-0.5, -1.5, 0, 0], [-1.0, -2.0, 0, 0], [-2.0, -3.0, -4.0, -5.0]]


def _per_prompt():
    """No top-k/top-p/min-p: the draw runs inside the step. Temperatures differ per prompt, prompt 1 is
    greedy, prompt 2 may not end before 5 tokens (its EOS banned until then), limits are ragged."""
    return [SamplingParams(max_new_tokens=14, temperature=0.7), SamplingParams(max_new_tokens=9, greedy=True),
            SamplingParams(max_new_tokens=12, temperature=1.3, min_new_tokens=5),
            SamplingParams(max_new_tokens=20, temperature=1.0)]


@pytest.mark.parametrize("merge", [True, False])
def test_the_draw_inside_the_step_samples_what_the_host_loop_samples(tiny_model_dir, merge):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 3, _per_prompt(), seed=11)
    eos = int(free.completion_ids_BTc[0, 2])  # declared EOS: rows end wherever they draw it
    eager, static = (BuiltinGenerator(tokenizer, [eos], tok.pad_id, merge=merge, decode=mode).sample(
        model, prompts, 3, _per_prompt(), seed=11) for mode in ("eager", "static"))
    assert torch.equal(eager.completion_ids_BTc, static.completion_ids_BTc)
    assert torch.equal(eager.completion_mask_BTc, static.completion_mask_BTc)
    assert eager.finish_reasons == static.finish_reasons and "stop" in eager.finish_reasons
    lengths = static.completion_mask_BTc.sum(-1)
    assert len(set(lengths.tolist())) > 2, "rows must end at different steps"
    assert int(lengths[6:9].min()) >= 5, "prompt 2's rows may not end before min_new_tokens"
    assert (eager.sampling_logp_BTc - static.sampling_logp_BTc).abs().max() < 1e-5


def test_the_loop_reads_back_once_every_check_and_stops_soon_after_the_last_row(tiny_model_dir, monkeypatch):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    reads, steps = [], []
    real_finished = device_loop.all_finished
    monkeypatch.setattr(device_loop, "all_finished", lambda rows: reads.append(1) or real_finished(rows))
    real_call = device_loop.StaticDecoder.__call__
    monkeypatch.setattr(device_loop.StaticDecoder, "__call__",
                        lambda self, tokens, positions, t: steps.append(t) or real_call(self, tokens, positions, t))
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode="static").sample(model, prompts, 2, params, seed=3)
    assert free.completion_mask_BTc.sum(-1).min() == 40  # nothing ends early: 39 steps, checks at t = 7, 15, ...
    assert len(steps) == 39 and len(reads) == 39 // CHECK_EVERY
    reads.clear(), steps.clear()
    half = list(range(0, len(tokenizer), 2))  # every even token id ends a row: rows end after a few tokens
    ended = BuiltinGenerator(tokenizer, half, tok.pad_id, decode="static").sample(model, prompts, 2, params, seed=3)
    last_end = int(ended.completion_mask_BTc.sum(-1).max())
    assert last_end < 40 - CHECK_EVERY, "every row must end early"
    assert last_end - 1 <= len(steps) < last_end - 1 + CHECK_EVERY  # it stops at the first check after the end
    assert len(reads) == len(steps) // CHECK_EVERY + 1
