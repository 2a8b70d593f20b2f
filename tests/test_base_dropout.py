"""A base whose config sets dropout (Seed-OSS ships attention and residual dropout 0.1) trains RL with it off: the
sampler and the no-grad passes run without dropout, so an update with it would compute another function and every
importance ratio would measure the dropout noise."""

import torch
from conftest import tiny_overrides

from rlora.cli import main
from rlora.config import ModelConfig
from rlora.models.loading import base_dropouts, load_base_model
from rlora.models.tiny import build_random_model


def _train_mode_logits_twice(model) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    ids = torch.arange(3, 19).reshape(2, 8)
    torch.manual_seed(0)
    first = model(input_ids=ids).logits
    torch.manual_seed(1)
    return first, model(input_ids=ids).logits


def test_no_dropout_switches_the_bases_dropout_off(tmp_path):
    path = str(build_random_model(tmp_path / "dropout", attention_dropout=0.5))
    assert base_dropouts(path) == {"attention_dropout": 0.5}
    as_shipped = load_base_model(ModelConfig(path=path), path)
    first, second = _train_mode_logits_twice(as_shipped)
    assert (first - second).abs().max() > 1e-3  # the shipped config draws a dropout mask per forward
    off = load_base_model(ModelConfig(path=path), path, no_dropout=True)
    assert off.config.attention_dropout == 0.0
    first, second = _train_mode_logits_twice(off)
    assert torch.equal(first, second)
    as_shipped.eval()
    assert torch.equal(first, as_shipped(input_ids=torch.arange(3, 19).reshape(2, 8)).logits)  # = the eval function
    assert base_dropouts(str(build_random_model(tmp_path / "none"))) == {}


def test_an_rl_run_says_the_bases_dropout_is_off(tmp_path, prompts_file, capsys):
    path = str(build_random_model(tmp_path / "dropout", attention_dropout=0.1))
    assert main(["train", *tiny_overrides(path, prompts_file, str(tmp_path / "out"), **{"train.steps": 1})]) == 0
    err = capsys.readouterr().err
    assert "model: the base's dropout (attention_dropout=0.1) is off in training, as in sampling" in err


def test_dropout_modules_and_other_config_keys_are_off_too(tmp_path):
    """GPT-2's kin keep attn_pdrop/resid_pdrop/embd_pdrop (0.1) as nn.Dropout modules: all are off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(folder)
    assert base_dropouts(str(folder)) == {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
    off = load_base_model(ModelConfig(path=str(folder)), str(folder), no_dropout=True)
    assert all(m.p == 0.0 for m in off.modules() if isinstance(m, torch.nn.Dropout))
    first, second = _train_mode_logits_twice(off)
    assert torch.equal(first, second)
