"""`rlora sft` with a `molora:` section: end to end (sequence router top-2; token router + hydra), the saved
folder reloads to the trained model's logits and eval loss, a fresh MoLoRA's loss is the base's, micro-batch
invariance of the gradient with the auxiliary losses, and bad combinations as one line with exit code 2."""

import json
from pathlib import Path

import pytest
import torch

from rlora.cli import main
from rlora.config import ModelConfig, SFTConfig, load_config
from rlora.data.sft_data import Conversation, load_sft_data, tokenize
from rlora.models import molora as ml
from rlora.models.adapters import adapter_of
from rlora.models.loading import load_base_model, load_tokenizer
from rlora.models.molora import MoLoRAConfig
from rlora.train import sft
from rlora.train.sft import backward_batch, collate, mean_loss, prompt_ids

ROWS = [{"prompt": f"What is {i} + {i}?" + " Think." * (i % 3), "completion": f"The answer is {2 * i}."}
        for i in range(6)] * 2


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def molora_config(tmp_path: Path, model_dir: str, data: str, molora: dict | None, **train) -> str:
    """A `rlora sft` config with a molora section (None: plain LoRA of rank 4 instead)."""
    values = {"steps": 2, "batch_size": 4, "micro_batch_size": 2, "lr": 0.01, "output_dir": str(tmp_path / "run")}
    values.update(train)
    adapter = "lora: {rank: 4}\n" if molora is None else f"molora: {json.dumps(molora)}\n"
    path = tmp_path / "sft.yaml"
    path.write_text(f"# rlora sft\nmodel: {{path: {model_dir}}}\n{adapter}data: {{path: {data}, eval_size: 3}}\n"
                    f"train: {json.dumps(values)}\n")
    return str(path)


def load_base(model_dir: str):
    return load_base_model(ModelConfig(path=model_dir), model_dir)


def routed_logits(model, rows) -> torch.Tensor:
    """Logits of the rows (right-padded) routed by their prompts, as training and eval route them."""
    device = next(model.parameters()).device
    ids, mask, _ = (t.to(device) for t in collate(rows, 0))
    with torch.no_grad(), adapter_of(model).prompt_routing([sft.prompt_ids(r) for r in rows]):
        return model(input_ids=ids, attention_mask=mask).logits.cpu()


@pytest.fixture()
def tiny_tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)[0]


def _rows(tokenizer, n: int = 4):
    """Rows of different prompt and completion lengths (padding in every micro-batch of more than one row)."""
    convs = [Conversation([{"role": "user", "content": "What is 3 + 4?" * (1 + i % 3)},
                           {"role": "assistant", "content": "The answer is 7." + " a" * (2 * i)}], True)
             for i in range(n)]
    return [tokenize(tokenizer, c, True, 0) for c in convs]


# ---- end to end ----------------------------------------------------------------------------------------

SETTINGS = {
    "sequence-top2": {"num_experts": 3, "rank": 4, "router": "sequence", "top_k": 2, "router_init_std": 0.5},
    "token-hydra": {"num_experts": 3, "rank": 4, "router": "token", "top_k": 2, "hydra": True,
                    "router_init_std": 0.5, "target_modules": ["q_proj", "v_proj", "down_proj"]},
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_sft_trains_and_saves_molora(name, tiny_model_dir, tmp_path, capsys, monkeypatch):
    trained = {}
    save = sft.save_outputs

    def keep_model(cfg, run_dir, model, tokenizer):  # the model as training left it, before it is saved
        trained["model"] = model
        save(cfg, run_dir, model, tokenizer)

    monkeypatch.setattr(sft, "save_outputs", keep_model)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    config = molora_config(tmp_path, tiny_model_dir, data, SETTINGS[name])
    assert main(["sft", config]) == 0, capsys.readouterr().err
    out = tmp_path / "run"
    assert sorted(p.name for p in (out / "adapter").iterdir()) == [ml.CONFIG_FILE, ml.WEIGHTS_FILE]
    assert not (out / "adapter" / "adapter_config.json").exists()  # not a PEFT folder
    meta, saved_cfg = ml.read_molora_meta(out / "adapter")
    assert saved_cfg == MoLoRAConfig(**SETTINGS[name])
    assert meta["base_model"] == tiny_model_dir and len(meta["modules"]) == len(ml.molora_modules(trained["model"]))

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert {"loss", "tokens", "grad_norm", "aux_loss", "molora/balance", "molora/z_loss",
                "molora/entropy"} <= set(m)
        utils = [m[f"molora/util_{e}"] for e in range(3)]
        assert sum(utils) == pytest.approx(1.0, abs=1e-5) and m["molora/balance"] >= 1.0 - 1e-5
        assert 0 < m["molora/entropy"] <= torch.log(torch.tensor(3.0)).item() + 1e-6 and m["aux_loss"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["eval_loss"] == metrics[-1]["eval_loss"]
    assert summary["trainable_params"] == sum(p.numel() for n, p in trained["model"].named_parameters()
                                              if ml.PARAM_TAG in n)
    assert "MoLoRA parameters" in " ".join(capsys.readouterr().err.split())  # rich wraps at the terminal width

    # the folder reloads onto a fresh base with the trained model's logits, bit for bit
    cfg = load_config(str(out / "config.yaml"), [], model_cls=SFTConfig)
    assert cfg.molora == saved_cfg
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    rows = load_sft_data(cfg.data, tokenizer, tok.eos_ids[0], cfg.train.max_length)
    probe = rows.train[:3] + rows.eval
    model = trained["model"].eval()
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("molora_B"))  # it learnt
    reloaded = load_base(tiny_model_dir)
    ml.load_molora(reloaded, out / "adapter")
    reloaded.eval()
    assert torch.equal(routed_logits(reloaded, probe), routed_logits(model, probe))
    assert not torch.equal(routed_logits(load_base(tiny_model_dir).eval(), probe), routed_logits(model, probe))
    # and the run's final eval loss, recomputed from the folder
    assert mean_loss(reloaded, rows.eval, cfg.train.micro_batch_size, tok.pad_id) == \
        pytest.approx(summary["eval_loss"], abs=1e-6)
    # the saved config runs again
    assert main(["sft", str(out / "config.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == (out / "config.yaml").read_text()


def test_first_step_loss_equals_plain_lora(tiny_model_dir, tmp_path, capsys):
    """LoRA and MoLoRA both start as the identity (B = 0): the first batch's loss is the base's in both."""
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    first = {}
    for name, molora in (("lora", None), ("molora", SETTINGS["sequence-top2"])):
        config = molora_config(tmp_path, tiny_model_dir, data, molora, steps=1, output_dir=str(tmp_path / name))
        assert main(["sft", config]) == 0, capsys.readouterr().err
        first[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    assert first["molora"]["tokens"] == first["lora"]["tokens"]
    assert first["molora"]["loss"] == pytest.approx(first["lora"]["loss"], abs=1e-6)


# ---- loss and gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("router", ["sequence", "token"])
def test_fresh_molora_loss_is_the_base_loss(router, tiny_model_dir, tiny_tokenizer):
    rows = _rows(tiny_tokenizer)
    pad = tiny_tokenizer.pad_token_id
    # float64: micro-batches of 4 and of 2 are different matmul shapes, whose float32 rounding differs by a
    # few ulps of the loss on some CPUs; in float64 1e-10 shows that a fresh MoLoRA adds exactly nothing
    base = load_base(tiny_model_dir).double()
    expected = mean_loss(base, rows, 4, pad)
    ml.attach_molora(base, MoLoRAConfig(num_experts=3, rank=4, router=router, top_k=2, router_init_std=0.5))
    base.double()
    assert mean_loss(base, rows, 2, pad) == pytest.approx(expected, abs=1e-10)
    metrics: dict = {}
    loss, _ = backward_batch(base, rows, 2, pad, metrics)
    assert loss == pytest.approx(expected, abs=1e-10)  # the task loss; the auxiliary loss is reported apart
    assert metrics["aux_loss"] > 0


def _molora_model(model_dir: str, router: str, hydra: bool = False, balance_coef: float = 0.5, z_coef: float = 0.1):
    """MoLoRA with non-zero B and spread-out routers, so routing varies by row (or token) and every expert,
    A and router gets a gradient from the task loss; large auxiliary weights so they weigh in the gradient.
    In float64 (the routing softmax stays float32, as in training)."""
    torch.manual_seed(0)
    model = load_base(model_dir)
    ml.attach_molora(model, MoLoRAConfig(num_experts=3, rank=2, router=router, top_k=2, hydra=hydra,
                                         balance_coef=balance_coef, z_coef=z_coef, router_init_std=0.3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("molora_B"):
                p.normal_(0, 0.1)
    # float64: the sums of another micro-batching differ only by rounding, which float32 makes ~1e-7 of the
    # gradient's size (~20 here, with these auxiliary weights); float64 leaves the normalisation to be tested
    return model.double()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("router, hydra", [("sequence", False), ("token", False), ("token", True)])
def test_micro_batching_does_not_change_the_gradient_or_the_aux_loss(router, hydra, tiny_model_dir, tiny_tokenizer):
    rows, pad = _rows(tiny_tokenizer), tiny_tokenizer.pad_token_id
    grads, metrics = {}, {}
    for micro in (4, 2, 1):
        model = _molora_model(tiny_model_dir, router, hydra)
        metrics[micro] = {}
        backward_batch(model, rows, micro, pad, metrics[micro])
        grads[micro] = _grads(model)
        if micro == 4:  # one forward over the whole batch: the core's definitions of the losses and metrics
            _, mask, _ = collate(rows, pad)
            assert metrics[4]["aux_loss"] == pytest.approx(ml.collect_aux_losses(model, mask).total.item(), rel=1e-6)
            for key, value in ml.router_metrics(model, mask).items():
                assert metrics[4][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert grads[4].keys() == grads[1].keys() and grads[4]
    for micro in (2, 1):
        for name in grads[4]:
            torch.testing.assert_close(grads[micro][name], grads[4][name], atol=1e-6, rtol=0)
        assert metrics[micro] == pytest.approx(metrics[4], rel=1e-6, abs=1e-6)  # float32 sums in another order
    routers = [n for n in grads[4] if "molora_router" in n]
    assert routers and all(grads[4][n].abs().sum() > 0 for n in routers)
    # the auxiliary losses are in that gradient: without them the routers' gradient differs
    model = _molora_model(tiny_model_dir, router, hydra, balance_coef=0.0, z_coef=0.0)
    backward_batch(model, rows, 1, pad)
    without = _grads(model)
    assert all(not torch.allclose(without[n], grads[4][n], atol=1e-6, rtol=0) for n in routers)


def test_prompt_of_a_row_is_what_a_sampler_is_given(tiny_tokenizer):
    """The routing prompt of a training row is the token list of its prompt with the generation prompt, so a
    sampler routing the same prompt sees the same summary."""
    messages = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}]
    row = tokenize(tiny_tokenizer, Conversation(messages, True), True, 0)
    text = tiny_tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt_ids(row) == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    plain = tokenize(tiny_tokenizer, Conversation(messages, True), False, tiny_tokenizer.eos_token_id)
    assert prompt_ids(plain) == tiny_tokenizer("What is 3 + 4?")["input_ids"]


# ---- bad input -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=4"], "lora.rank does not apply with molora (the experts use molora.rank): remove lora.rank"),
    (["lora.target_modules=[q_proj]"], "lora.target_modules does not apply with molora"),
    (["lora.init_from=some/adapter"], "lora.init_from loads a PEFT adapter; molora starts its experts fresh"),
    (["lora.top_layers=1"], "lora.top_layers is not supported with molora"),
    (["lora.layers=[0]"], "lora.layers is not supported with molora"),
    (["lora.use_rslora=true"], "lora.use_rslora is not supported with molora"),
    (["train.full_finetune=true"], "molora trains adapters; train.full_finetune trains the model itself"),
    (["molora.top_k=4"], "top_k=4 exceeds num_experts=3"),
    (["molora.topk=2"], "unknown config key 'molora.topk' (did you mean 'molora.top_k'?)"),
    (["molora.router=layer"], "invalid value for molora.router"),
    (["molora.target_modules=[nope_proj]"], "MoLoRA target_modules ['nope_proj'] match no linear layer"),
])
def test_bad_combinations_are_one_line(overrides, message, tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    config = molora_config(tmp_path, tiny_model_dir, data, SETTINGS["sequence-top2"])
    assert main(["sft", config, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlora: error: ") and "\n" not in err and message in err, err
    if "nope_proj" not in message:  # config errors: caught before anything is written
        assert not (tmp_path / "run").exists()


def test_molora_null_is_plain_lora(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    cfg = load_config(molora_config(tmp_path, tiny_model_dir, data, None), [], model_cls=SFTConfig)
    assert cfg.molora is None and cfg.lora.rank == 4
    assert load_config(molora_config(tmp_path, tiny_model_dir, data, None), ["molora=null"],
                       model_cls=SFTConfig).molora is None
