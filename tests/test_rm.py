"""`rlora rm`: the Bradley-Terry loss and pair accuracy by hand, the score read at the last real token of
ragged rows, save/reload with identical scores (on a fresh base and beside a policy adapter), micro-batch
invariance, end to end on the tiny model, and bad input as one line with exit code 2."""

import json
import math
from pathlib import Path

import pytest
import torch

from rlora.cli import main
from rlora.config import LoraConfig, ModelConfig, RMDataConfig
from rlora.data.pref_data import TokenizedPair, encode_parts, fit, load_preference_data
from rlora.errors import UserError
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer
from rlora.models.reward_model import (
    last_token_index, load_reward_model, new_score_head, save_reward_model, score,
)
from rlora.models.tiny import build_random_model
from rlora.train.rm import backward_batch, bradley_terry_loss, pair_accuracy


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


WORDS = ["x", "y", "z", "hello", "fox", "dog", "cat", "sun", "one", "two"]
# learnable: the chosen response is made of 'a', the rejected one of 'b'
PAIRS = [{"prompt": f"Say {w}", "chosen": f"a {w} a", "rejected": f"b {w} b"} for w in WORDS]


def rm_config(tmp_path: Path, model_dir: str, data: str, data_extra: dict | None = None, **train) -> str:
    values = {"steps": 2, "batch_size": 4, "micro_batch_size": 2, "lr": 0.01, "output_dir": str(tmp_path / "run")}
    values.update(train)
    data_values = {"path": data, **(data_extra or {})}
    text = (f"# rlora rm\nmodel: {{path: {model_dir}}}\nlora: {{rank: 4}}\ndata: {json.dumps(data_values)}\n"
            f"train: {json.dumps(values)}\n")
    path = tmp_path / "rm.yaml"
    path.write_text(text)
    return str(path)


def reward_model(model_dir: str, seed: int = 1):
    """The tiny base with a LoRA adapter whose B is random (so it changes the scores) and a random head."""
    model = attach_lora(load_base_model(ModelConfig(path=model_dir), model_dir), LoraConfig(rank=4))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.eval()
    return model, new_score_head(64, init_std=0.1)


RAGGED = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17]]


def right_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


# ---- pure math -----------------------------------------------------------------------------------------

def test_bradley_terry_loss_by_hand():
    zero = torch.tensor([0.0])
    assert bradley_terry_loss(zero, zero).item() == pytest.approx(math.log(2))
    # r_c - r_r = 1: log(1 + e^-1); = -2: log(1 + e^2); mean of the two
    chosen, rejected = torch.tensor([1.5, -1.0]), torch.tensor([0.5, 1.0])
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2))) / 2
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)
    # a margin is subtracted from the difference: 1 - 1 = 0 -> log 2; 1 - 3 = -2 -> log(1 + e^2)
    assert bradley_terry_loss(torch.tensor([1.0]), zero, torch.tensor([1.0])).item() == pytest.approx(math.log(2))
    assert bradley_terry_loss(torch.tensor([1.0]), zero, torch.tensor([3.0])).item() == \
        pytest.approx(math.log(1 + math.exp(2)), rel=1e-6)
    # gradient w.r.t. r_c at difference 0 is -sigmoid(0) = -1/2 (per pair, mean over 1 pair)
    r_c = torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(r_c, zero).backward()
    assert r_c.grad.item() == pytest.approx(-0.5)


def test_pair_accuracy_counts_ties_as_wrong():
    assert pair_accuracy(torch.tensor([1.0, 0.0, 2.0, 5.0]), torch.tensor([0.0, 0.0, 3.0, 4.0])) == 0.5


def test_fit_cuts_the_prompt_from_the_left_or_drops():
    assert fit([1, 2, 3], [4, 5], 5) == ([1, 2, 3, 4, 5], False)
    assert fit([1, 2, 3], [4, 5], 4) == ([2, 3, 4, 5], True)
    assert fit([1, 2, 3], [4, 5], 3) == ([3, 4, 5], True)
    assert fit([1, 2, 3], [4, 5], 2) == (None, True)  # no prompt token would be left


def test_last_token_index_right_and_left_padding():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 0, 3]
    assert last_token_index(mask.flip(-1)).tolist() == [3, 3, 3]


# ---- the score, saving and loading ----------------------------------------------------------------------

def naive_scores(model, head, rows: list[list[int]]) -> torch.Tensor:
    """Each row alone, no padding: the full model's last hidden state (after the final norm) at its end."""
    out = []
    for row in rows:
        hidden = model(input_ids=torch.tensor([row]), output_hidden_states=True).hidden_states[-1]
        out.append(head(hidden[0, -1].float()))
    return torch.cat(out)


@torch.no_grad()
def test_score_reads_the_last_real_token_of_ragged_rows(tiny_model_dir):
    model, head = reward_model(tiny_model_dir)
    ids, mask = right_padded(RAGGED)
    batched = score(model, head, ids, mask)
    assert batched.shape == (4,) and batched.dtype == torch.float32
    torch.testing.assert_close(batched, naive_scores(model, head, RAGGED), atol=1e-5, rtol=0)
    assert len(set(batched.tolist())) == 4  # the rows do score differently (the test is not vacuous)
    # the adapter is part of the score
    with model.disable_adapter():
        assert not torch.allclose(score(model, head, ids, mask), batched)


@torch.no_grad()
def test_saved_reward_model_reloads_with_identical_scores(tiny_model_dir, tmp_path):
    model, head = reward_model(tiny_model_dir)
    ids, mask = right_padded(RAGGED)
    before = score(model, head, ids, mask)
    save_reward_model(tmp_path / "rm", model, head)
    names = {p.name for p in (tmp_path / "rm").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "score_head.safetensors", "reward_model.json"} <= names
    meta = json.loads((tmp_path / "rm" / "reward_model.json").read_text())
    assert meta["hidden_size"] == 64 and meta["score"] == "last_real_token" and meta["version"] == 1

    fresh = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    loaded, loaded_head = load_reward_model(str(tmp_path / "rm"), fresh)
    assert torch.equal(score(loaded, loaded_head, ids, mask), before)
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded_head.weight.requires_grad

    # beside a policy adapter on the same base (what `rlora train` with a reward adapter will do)
    policy = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir), LoraConfig(rank=4))
    policy, policy_head = load_reward_model(str(tmp_path / "rm"), policy, adapter_name="reward")
    assert set(policy.peft_config) == {"default", "reward"}
    policy.set_adapter("reward")
    assert torch.equal(score(policy, policy_head, ids, mask), before)


def test_micro_batches_do_not_change_the_gradient(tiny_model_dir):
    model, head = reward_model(tiny_model_dir)
    pairs = [TokenizedPair([5, 6, 7], [5, 6, 8, 9], 0.0), TokenizedPair([11, 12], [13], 0.5),
             TokenizedPair([14, 15, 16, 17, 18], [14, 15], 0.0), TokenizedPair([19], [20, 21, 22], -0.3)]
    params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())

    def grads(micro: int) -> tuple[dict, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        stats = backward_batch(model, head, pairs, micro, pad_id=0, margin=0.1)
        return stats, [p.grad.clone() for p in params]

    whole, whole_grads = grads(4)
    split, split_grads = grads(1)
    assert whole["loss"] == pytest.approx(split["loss"], abs=1e-6) and whole["accuracy"] == split["accuracy"]
    for a, b in zip(whole_grads, split_grads):  # float32 summation order: ~1e-6 relative on entries near 1
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in whole_grads)


# ---- data ----------------------------------------------------------------------------------------------

def test_pairs_tokenize_as_assistant_turns_with_margins(tiny_model_dir, tmp_path):
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    rows = [{"prompt": "Say x", "chosen": "a x", "rejected": "b", "m": 1.5}]
    cfg = RMDataConfig(path=write_jsonl(tmp_path / "p.jsonl", rows), margin_column="m")
    data = load_preference_data(cfg, tokenizer, tok.eos_ids[0], 1024)
    pair = data.train[0]
    assert pair.margin == 1.5
    messages = [{"role": "user", "content": "Say x"}, {"role": "assistant", "content": "a x"}]
    assert tokenizer.decode(pair.chosen_ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    prompt_ids, response_ids = encode_parts(tokenizer, "Say x", "b", cfg.model_copy(update={"use_chat_template": False}),
                                            tok.eos_ids[0])
    assert response_ids == tokenizer("b", add_special_tokens=False)["input_ids"] + [tok.eos_ids[0]]
    # max_length cuts the prompt from the left (counted), or drops the pair when the response fills it
    short = load_preference_data(cfg, tokenizer, tok.eos_ids[0], len(pair.chosen_ids) - 2)
    assert short.truncated == 1 and short.train[0].chosen_ids == pair.chosen_ids[2:]


# ---- end to end ----------------------------------------------------------------------------------------

def test_rm_end_to_end_learns_the_preference(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    config = rm_config(tmp_path, tiny_model_dir, data, {"eval_size": 2}, steps=15, eval_every=5)
    assert main(["rm", config]) == 0
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 16))
    assert {"loss", "accuracy", "lr", "step_s", "grad_norm"} <= set(metrics[0])
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # zero head: every score 0
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    assert metrics[0]["accuracy"] == 0.0 and metrics[-1]["accuracy"] == 1.0
    assert [m["step"] for m in metrics if "eval_accuracy" in m] == [5, 10, 15]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["train_pairs"] == 8 and summary["eval_pairs"] == 2
    assert summary["eval_accuracy"] == metrics[-1]["eval_accuracy"] == 1.0
    # the saved reward model scores a held-out-like pair the learnt way round
    base = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    model, head = load_reward_model(str(run / "reward_model"), base)
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    cfg = RMDataConfig(path=data)
    chosen = sum(encode_parts(tokenizer, "Say moon", "a moon a", cfg, tok.eos_ids[0]), [])
    rejected = sum(encode_parts(tokenizer, "Say moon", "b moon b", cfg, tok.eos_ids[0]), [])
    with torch.no_grad():
        r = score(model, head, *right_padded([chosen, rejected], tok.pad_id))
    assert r[0] > r[1]


def test_rm_two_steps_with_margin_column_and_eval_path(tiny_model_dir, tmp_path):
    rows = [dict(p, m=0.5) for p in PAIRS]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows[:8])
    held = write_jsonl(tmp_path / "held.jsonl", rows[8:])
    config = rm_config(tmp_path, tiny_model_dir, data, {"eval_path": held, "margin_column": "m"}, micro_batch_size=4)
    assert main(["rm", config]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_pairs"] == 2 and summary["eval_accuracy"] is not None
    # zero head: every score 0, so the first loss is -log sigmoid(-0.5)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(math.log(1 + math.exp(0.5)), abs=1e-6)


# ---- bad input -----------------------------------------------------------------------------------------

def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlora: error: ") and "\n" not in err
    return err


def test_bad_preference_files_give_one_line(tiny_model_dir, tmp_path, capsys):
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "p", "rejected": "b"}])
    err = _one_line_error(capsys, ["rm", rm_config(tmp_path, tiny_model_dir, missing)])
    assert "has no column 'chosen'" in err and "data.chosen_column" in err
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"prompt": "p", "chosen": "", "rejected": "b"}])
    assert "row 1: column 'chosen' must hold non-empty text" in _one_line_error(
        capsys, ["rm", rm_config(tmp_path, tiny_model_dir, blank)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "has no rows" in _one_line_error(capsys, ["rm", rm_config(tmp_path, tiny_model_dir, str(empty))])
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    assert "leaves no training rows" in _one_line_error(
        capsys, ["rm", rm_config(tmp_path, tiny_model_dir, data, {"eval_size": 10})])
    bad_margin = write_jsonl(tmp_path / "margin.jsonl", [dict(PAIRS[0], m="big")])
    assert "column 'm' must hold a finite number" in _one_line_error(
        capsys, ["rm", rm_config(tmp_path, tiny_model_dir, bad_margin, {"margin_column": "m"})])
    assert "not divisible" in _one_line_error(
        capsys, ["rm", rm_config(tmp_path, tiny_model_dir, data, batch_size=3)])
    assert not (tmp_path / "run").exists()


def test_reward_folder_for_another_base_is_refused(tiny_model_dir, tmp_path):
    model, head = reward_model(tiny_model_dir)
    save_reward_model(tmp_path / "rm", model, head)
    other_dir = build_random_model(tmp_path / "other", hidden=32, ffn=64, seed=3)
    other = load_base_model(ModelConfig(path=str(other_dir)), str(other_dir))
    with pytest.raises(UserError) as err:
        load_reward_model(str(tmp_path / "rm"), other)
    assert "hidden size 64" in str(err.value) and "this base has 32" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="not a reward model folder"):
        load_reward_model(str(tmp_path), other)
