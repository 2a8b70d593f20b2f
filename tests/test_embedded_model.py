"""The real embedded SmolLM2-135M-Instruct (slow: converts the GGUF once, then trains on it)."""

import json

import pytest
import torch

from rlora.cli import main

pytestmark = pytest.mark.slow


def test_alias_converts_to_a_plain_hf_folder_that_answers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlora.models.embedded import resolve_alias

    folder = resolve_alias("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576 and model.config.tie_word_embeddings
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


def test_demo_config_trains_two_steps_on_the_real_model(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["train", "train.steps=2", "data.eval_size=8", f"train.output_dir={out}", "train.sample_every=1"])
    err = capsys.readouterr().err
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["gen_tokens"] > 0 for r in rows)
    evals = json.loads((out / "eval.json").read_text())
    assert evals["before"]["n"] == 8 and evals["after"]["n"] == 8
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["adapter_params"] == 4_884_480
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
