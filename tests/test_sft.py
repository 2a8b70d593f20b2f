"""`rlora sft`: the label mask by hand, the loss against a naive reference, micro-batch invariance, the
length-grouped order, end to end on the tiny model (LoRA then RL from its adapter; full fine-tuning), and
bad input as one line with exit code 2."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_overrides
from rlora.cli import main
from rlora.config import LoraConfig, ModelConfig
from rlora.data.sft_data import (
    IGNORE, Conversation, LengthGroupedOrder, TokenizedRow, mask_labels, num_targets, tokenize, truncate,
)
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer
from rlora.train import sft
from rlora.train.sft import backward_batch, mean_loss


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_config(tmp_path: Path, model_dir: str, data: str, **train) -> str:
    values = {"steps": 2, "batch_size": 4, "micro_batch_size": 2, "lr": 0.01, "output_dir": str(tmp_path / "run")}
    values.update(train)
    text = (f"# rlora sft\nmodel: {{path: {model_dir}}}\nlora: {{rank: 4}}\ndata: {{path: {data}}}\n"
            f"train: {json.dumps(values)}\n")
    path = tmp_path / "sft.yaml"
    path.write_text(text)
    return str(path)


REPETITIVE = [{"prompt": f"What is {i} + {i}?", "completion": f"The answer is {2 * i}."} for i in range(4)] * 2


@pytest.fixture()
def tiny_tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)[0]


# ---- labels --------------------------------------------------------------------------------------------

def test_mask_labels_by_hand():
    row = mask_labels([([11, 12, 13], False), ([14, 15], True), ([16], False), ([17], True)])
    assert row.ids == [11, 12, 13, 14, 15, 16, 17]
    assert row.labels == [IGNORE, IGNORE, IGNORE, 14, 15, IGNORE, 17]
    assert num_targets(row) == 3
    assert truncate(row, 4) == TokenizedRow([11, 12, 13, 14], [IGNORE, IGNORE, IGNORE, 14])


def _trained_text(tokenizer, row: TokenizedRow) -> str:
    return tokenizer.decode([t for t in row.labels if t != IGNORE])


def test_chat_rows_train_on_every_assistant_turn_only(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "3 + 4?"}, {"role": "assistant", "content": "7"}]
    row = tokenize(tiny_tokenizer, Conversation(messages, last_turn_only=False), True, 0)
    assert tiny_tokenizer.decode(row.ids) == tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert _trained_text(tiny_tokenizer, row) == "hello<|im_end|>\n7<|im_end|>\n"
    # a prompt/completion row whose prompt holds earlier turns: only the completion is trained on
    row = tokenize(tiny_tokenizer, Conversation(messages, last_turn_only=True), True, 0)
    assert _trained_text(tiny_tokenizer, row) == "7<|im_end|>\n"


def test_plain_prompt_completion_without_chat_template(tiny_tokenizer):
    conv = Conversation([{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": " 7"}], True)
    row = tokenize(tiny_tokenizer, conv, False, tiny_tokenizer.eos_token_id)
    prompt = tiny_tokenizer("What is 3 + 4?")["input_ids"]
    completion = tiny_tokenizer(" 7", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert row.ids == prompt + completion
    assert row.labels == [IGNORE] * len(prompt) + completion


# ---- loss and gradients ----------------------------------------------------------------------------------

def _rows(tokenizer, n: int = 4) -> list[TokenizedRow]:
    convs = [Conversation([{"role": "user", "content": "What is 3 + 4?" * (1 + i)},
                           {"role": "assistant", "content": "The answer is 7." + " a" * i}], True) for i in range(n)]
    return [tokenize(tokenizer, c, True, 0) for c in convs]


def _lora_model(model_dir: str):
    torch.manual_seed(0)
    model = attach_lora(load_base_model(ModelConfig(path=model_dir), model_dir), LoraConfig(rank=4))
    with torch.no_grad():  # a non-zero B, so the adapter changes the logits and every LoRA weight gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def test_loss_equals_naive_per_row_reference(tiny_model_dir, tiny_tokenizer):
    """In float64: the padded micro-batches and the unpadded rows are different matmul shapes, whose float32
    rounding differs by a few ulps of the loss on some CPUs; in float64 that is ~1e-15, so 1e-10 shows that
    the masking and the token count are exact."""
    model, rows = _lora_model(tiny_model_dir).double(), _rows(tiny_tokenizer)
    total, nll = 0, 0.0
    with torch.no_grad():
        for row in rows:  # one row at a time, no padding: cross-entropy over the completion positions
            logits = model(input_ids=torch.tensor([row.ids])).logits[0]
            targets = torch.tensor(row.labels)
            keep = targets[1:] != IGNORE
            nll += F.cross_entropy(logits[:-1][keep], targets[1:][keep], reduction="sum").item()
            total += int(keep.sum())
    loss, tokens = backward_batch(model, rows, 4, tiny_tokenizer.pad_token_id)
    assert tokens == total
    assert loss == pytest.approx(nll / total, abs=1e-10)
    assert mean_loss(model, rows, 3, tiny_tokenizer.pad_token_id) == pytest.approx(nll / total, abs=1e-10)


def test_the_output_layer_runs_only_where_a_token_is_trained_with_the_full_logits_loss_and_gradient(
        tiny_model_dir, tiny_tokenizer):
    """labelled_nll_sum against token_nll_sum of the model's full logits on one padded batch with prompts, in
    float64 (so 1e-10 means the same computation up to summation order): the same loss, the same gradient, and
    the output layer fed exactly the positions that predict a trained token."""
    rows = _rows(tiny_tokenizer)
    ids, mask, labels = sft.collate(rows, tiny_tokenizer.pad_token_id)
    results = []
    for labelled_only in (True, False):
        model = _lora_model(tiny_model_dir).double()
        fed = []
        hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: fed.append(args[0].shape[:-1]))
        nll = (sft.labelled_nll_sum(model, ids, mask, labels) if labelled_only
               else sft.token_nll_sum(model(input_ids=ids, attention_mask=mask).logits, labels))
        nll.backward()
        hook.remove()
        results.append((nll.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, fed))
    (labelled, grads, fed), (full, full_grads, full_fed) = results
    assert fed == [(sum(num_targets(r) for r in rows),)] and full_fed == [tuple(ids.shape)]
    assert labelled == pytest.approx(full, abs=1e-10)
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-10, rtol=0)


def test_micro_batching_does_not_change_the_gradient(tiny_model_dir, tiny_tokenizer):
    rows = _rows(tiny_tokenizer)
    grads = []
    for micro in (4, 1):
        model = _lora_model(tiny_model_dir)
        backward_batch(model, rows, micro, tiny_tokenizer.pad_token_id)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=0)
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_length_grouped_order():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    order = LengthGroupedOrder(lengths, batch_size=2, window=2, seed=0)
    epoch = [i for step in range(4) for i in order.indices(step)]
    assert sorted(epoch) == list(range(8))  # an epoch uses every row once
    for window in (epoch[:4], epoch[4:]):  # each window of 2 batches is sorted by length
        assert [lengths[i] for i in window] == sorted(lengths[i] for i in window)
    assert epoch == [i for step in range(4) for i in LengthGroupedOrder(lengths, 2, 2, 0).indices(step)]
    assert sorted(order.indices(4) + order.indices(5) + order.indices(6) + order.indices(7)) == list(range(8))


# ---- end to end ----------------------------------------------------------------------------------------

def test_sft_end_to_end_then_rl_from_its_adapter(tiny_model_dir, prompts_file, tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", REPETITIVE)
    config = sft_config(tmp_path, tiny_model_dir, data, steps=10, eval_every=5)
    out = tmp_path / "run"
    assert main(["sft", config, "data.eval_size=2"]) == 0, capsys.readouterr().err
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "adapter/adapter_config.json",
                 "adapter/adapter_model.safetensors"):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert {"step", "loss", "lr", "tokens", "step_s", "grad_norm"} <= set(rows[0]) and rows[0]["tokens"] > 0
    assert [r["step"] for r in rows if "eval_loss" in r] == [5, 10]
    assert rows[-1]["loss"] < rows[0]["loss"]  # the same few rows again and again: learnt
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert (summary["train_rows"], summary["eval_rows"]) == (6, 2) and summary["eval_loss"] == rows[-1]["eval_loss"]
    assert "rlora sft: done" in capsys.readouterr().err
    assert main(["sft", str(out / "config.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == (out / "config.yaml").read_text()
    # the adapter is what `rlora train` continues from
    rl_out = tmp_path / "rl"
    args = tiny_overrides(tiny_model_dir, prompts_file, str(rl_out), **{
        "lora.init_from": str(out / "adapter"), "train.steps": 1, "eval.before": "false", "eval.after": "false"})
    assert main(["train", *args]) == 0, capsys.readouterr().err
    assert (rl_out / "adapter" / "adapter_model.safetensors").is_file()


def test_chat_rows_end_to_end(tiny_model_dir, tmp_path, capsys):
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 4
    data = write_jsonl(tmp_path / "chat.jsonl", chats)
    config = sft_config(tmp_path, tiny_model_dir, data, steps=1)
    assert main(["sft", config, "data.messages_column=messages", "data.system_prompt=Be brief."]) == 0, \
        capsys.readouterr().err
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


def test_epochs_set_the_steps_and_the_config_reruns(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", REPETITIVE)  # 8 rows, batches of 4: 1.5 epochs = 3 steps
    config = sft_config(tmp_path, tiny_model_dir, data, steps=None, epochs=1.5, group_window=1)
    assert main(["sft", config]) == 0, capsys.readouterr().err
    out = tmp_path / "run"
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert main(["sft", str(out / "config.yaml"), "--print-config"]) == 0  # steps: null + epochs reload
    assert capsys.readouterr().out == (out / "config.yaml").read_text()


def test_full_finetune_writes_a_transformers_folder(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_jsonl(tmp_path / "rows.jsonl", REPETITIVE)
    config = sft_config(tmp_path, tiny_model_dir, data, full_finetune=True)
    assert main(["sft", config]) == 0, capsys.readouterr().err
    folder = tmp_path / "run" / "model"
    tuned = AutoModelForCausalLM.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(tuned.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
    assert not (tmp_path / "run" / "adapter").exists()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["trainable_params"] == \
        sum(p.numel() for p in base.parameters())


# ---- bad input -----------------------------------------------------------------------------------------

def _error(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlora: error: ") and "\n" not in err
    return err


def test_full_finetune_refuses_a_large_model(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sft, "FULL_FINETUNE_MAX_PARAMS", 1000)
    data = write_jsonl(tmp_path / "rows.jsonl", REPETITIVE)
    config = sft_config(tmp_path, tiny_model_dir, data, full_finetune=True)
    assert "over the" in _error(["sft", config], capsys)


@pytest.mark.parametrize("rows, overrides, message", [
    (None, ["data.path=/nonexistent/rows.jsonl"], "data file not found"),
    (REPETITIVE, ["data.completion_column=answer"], "has no column 'answer'"),
    (REPETITIVE, ["data.prompt_column=question"], "set data.prompt_column"),
    ([], [], "rows.jsonl has no rows"),  # an empty file
    ([{"messages": [{"role": "user", "content": "hi"}]}], ["data.messages_column=messages"], "no assistant turn"),
    (REPETITIVE, ["data.eval_size=8"], "leaves no training rows"),
    (REPETITIVE, ["train.epochs=1"], "train.steps or train.epochs"),
    (REPETITIVE, ["train.micro_batch_size=3"], "not divisible"),
    (REPETITIVE, ["train.full_finetune=true", "lora.init_from=x"], "full_finetune"),
    (REPETITIVE, ["train.stesp=3"], "did you mean 'train.steps'"),
])
def test_bad_input_is_one_line(rows, overrides, message, tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", rows or [])
    config = sft_config(tmp_path, tiny_model_dir, data)
    assert message in _error(["sft", config, *overrides], capsys)


def test_sft_needs_a_config(capsys):
    assert "needs a CONFIG.yaml" in _error(["sft", "train.steps=3"], capsys)
