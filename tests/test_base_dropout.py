"""A base whose config sets dropout (Seed-OSS ships attention and residual dropout 0.1) trains RL with it off: the
sampler and the no-grad passes run without dropout, so an update with it would compute another function and every
importance ratio would measure the dropout noise."""

import torch
from conftest import tiny_overrides

from rlora.cli import main
from rlora.config import ModelConfig
from rlora.models.dropouts import base_dropouts
from rlora.models.loading import load_base_model
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


def test_a_starting_adapters_dropout_is_off_in_rl_and_a_set_one_is_refused(tiny_model_dir, prompts_file, tmp_path,
                                                                           capsys):
    """The adapter's dropout, as the base's: an update that dropped adapter inputs would make the importance weights
    measure that noise against the sampler's (a 0.115-nat sampler_logp_gap at lora.dropout=0.1, measured). A
    lora.init_from adapter saved with lora_dropout 0.3 trains with it off (notice; the float32 sampler's gap to the
    update's log-probs is float32 rounding, the importance weights 1); lora.dropout set in the config is refused."""
    import json

    from rlora.config import LoraConfig
    from rlora.models.loading import attach_lora, save_adapter
    from test_policy_model import perturb_adapter

    adapter = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir),
                          LoraConfig(rank=4, dropout=0.3))
    perturb_adapter(adapter, scale=0.3, seed=1)  # non-zero B: dropping its inputs changes the log-probs
    save_adapter(adapter, tmp_path / "start")
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "lora.init_from": str(tmp_path / "start"), "lora.rank": 16, "rollout.sampler_dtype": "model",
        "algo.sampler_is_cap": 2.0, "train.steps": 2})]) == 0
    assert "lora.init_from: the adapter's lora_dropout (0.3) is off in training, as in sampling" in capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sampler_logp_gap"] < 1e-5 and abs(r["is_weight_mean"] - 1) < 1e-5 for r in rows), rows
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "refused"),
                                          **{"lora.dropout": 0.1})]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lora.dropout=0.1 in rlora train" in err, err
