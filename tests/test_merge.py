"""`rlora merge`: the merged Hugging Face folder gives the logits of base + adapter, without peft."""

import pytest
import torch
from test_policy_model import make_policy, perturb_adapter
from transformers import AutoModelForCausalLM

from rlora.cli import main
from rlora.models.loading import save_adapter
from rlora.models.tiny import build_random_model


@pytest.fixture()
def adapter_dir(tiny_model_dir, tmp_path):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, scale=0.2)
    folder = tmp_path / "adapter"
    save_adapter(model, folder)
    return folder, model, tokenizer


def test_merged_model_equals_base_plus_adapter(adapter_dir, tmp_path, capsys):
    folder, policy, tokenizer = adapter_dir
    out = tmp_path / "merged"
    assert main(["merge", str(folder), "-o", str(out)]) == 0
    assert "rlora merge:" in capsys.readouterr().err
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("lora" in name for name, _ in merged.named_parameters())
    ids = torch.tensor([tokenizer("What is 3 + 4? The answer is")["input_ids"]])
    policy.eval()
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        with policy.disable_adapter():
            base = policy(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5
    assert (base - want).abs().max() > 1e-3  # the adapter matters, so the equality above means something


def test_merge_bad_input_is_one_line(adapter_dir, tmp_path, capsys):
    folder, _, _ = adapter_dir
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cases = [
        (["merge", str(tmp_path / "nope"), "-o", str(tmp_path / "o1")], "nope' not found"),
        (["merge", str(folder), "-o", str(out)], "already holds files"),
        (["merge", str(folder), "-o", str(tmp_path / "o2"), "--base",
          str(build_random_model(tmp_path / "other", family="qwen2", hidden=96, seed=2))], "does not fit model"),
    ]
    for args, message in cases:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert (out / "keep.txt").read_text() == "mine" and not (tmp_path / "o2").exists()


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`", "ignore:Setting `save_embedding_layers`")
@pytest.mark.parametrize("lora", [{"target_modules": ["q_proj", "lm_head"]}, {"target_modules": ["embed_tokens", "v_proj"]},
                                  {"target_modules": ["q_proj"], "trainable_token_indices": [5, 17, 33]}])
def test_an_adapter_on_a_tied_embedding_is_merged_into_that_side_only(lora, tiny_model_dir, tmp_path, capsys):
    """The tiny model ties its input embeddings and output layer (one tensor, as SmolLM2 does). A LoRA on the output
    layer (rlora serve's train_unembed) or on the embeddings, folded into the shared tensor, would move the other side
    too: the merged folder unties them, so its logits are base + adapter and the untouched side keeps the base's.
    Trainable token rows (peft ties them on both sides of a tied base) move both sides, once each."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    embeddings = base.get_input_embeddings().weight.detach().clone()
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **lora))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, param in policy.named_parameters():
            if "lora_" in name or "trainable_tokens" in name:  # random: peft starts B, an embedding's A, deltas at 0
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    folder, out = tmp_path / "adapter", tmp_path / "merged"
    policy.save_pretrained(folder)
    assert main(["merge", str(folder), "-o", str(out), "--base", tiny_model_dir]) == 0, capsys.readouterr().err
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([[5, 17, 33, 8, 41, 12, 7]])
    policy.eval()
    with torch.no_grad():
        want, got = policy(input_ids=ids).logits, merged(input_ids=ids).logits
        with policy.disable_adapter():
            assert (policy(input_ids=ids).logits - want).abs().max() > 1e-3  # the adapter matters
    assert (got - want).abs().max() < 1e-5
    if "trainable_token_indices" in lora:  # both sides moved by the same rows
        assert torch.equal(merged.get_input_embeddings().weight, merged.get_output_embeddings().weight)
        assert not torch.equal(merged.get_input_embeddings().weight, embeddings)
    else:
        untouched = merged.get_input_embeddings() if "lm_head" in lora["target_modules"] else merged.get_output_embeddings()
        assert torch.equal(untouched.weight, embeddings)
