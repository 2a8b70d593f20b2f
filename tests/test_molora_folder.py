"""MoLoRA folders (src/rlora/models/molora/folder.py): save and reload bit-identical, and every bad folder is a
one-line user error. The layer, the losses and the routing are tested in tests/test_molora.py."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlora.errors import UserError
from rlora.models import molora as ml
from rlora.models.molora import MoLoRAConfig
from rlora.models.tiny import build_random_model
from test_molora import PROMPTS, left_pad, load_base, one_line, randomise

@pytest.mark.parametrize("router,hydra", [("sequence", False), ("token", True)])
def test_save_and_reload_bit_identical(tiny_model_dir, tmp_path, router, hydra):
    model = load_base(tiny_model_dir)
    cfg = MoLoRAConfig(num_experts=3, rank=4, router=router, hydra=hydra, target_modules=["q_proj", "down_proj"])
    ml.attach_molora(model, cfg)
    randomise(model)
    ml.save_molora(model, tmp_path / "adapter")
    meta = json.loads((tmp_path / "adapter" / ml.CONFIG_FILE).read_text())
    assert meta["format"] == ml.FORMAT and meta["version"] == ml.VERSION and meta["hidden_size"] == 64
    assert MoLoRAConfig.model_validate(meta["config"]) == cfg
    assert meta["modules"] == [n for n, _ in ml.molora_modules(model)]

    tensors = load_file(str(tmp_path / "adapter" / ml.WEIGHTS_FILE))
    assert tensors["model.layers.0.self_attn.q_proj.molora_B"].shape == (3, 64, 4)
    assert tensors["model.layers.1.mlp.down_proj.molora_A"].shape == ((4, 128) if hydra else (3, 4, 128))

    fresh = load_base(tiny_model_dir)
    params = ml.load_molora(fresh, tmp_path / "adapter")
    assert params and not any(p.requires_grad for p in fresh.parameters())
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        outs = []
        for m in (model, fresh):
            with ml.routing_from_prompts(m, PROMPTS):
                outs.append(m(input_ids=ids, attention_mask=mask).logits)
    assert torch.equal(outs[0], outs[1])
    trainable = ml.load_molora(load_base(tiny_model_dir), tmp_path / "adapter", trainable=True)
    assert all(p.requires_grad for p in trainable)


def _saved(tiny_model_dir, folder):
    model = load_base(tiny_model_dir)
    ml.attach_molora(model, MoLoRAConfig(num_experts=2, rank=2, target_modules=["q_proj"]))
    ml.save_molora(model, folder)
    return folder


def _edit_meta(folder, **changes):
    path = folder / ml.CONFIG_FILE
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def _do(_, folder):
    return folder


BAD_FOLDERS = {
    "missing": (lambda f: f / "nowhere", "not a MoLoRA adapter folder"),
    "no_config": (lambda f: (f / ml.CONFIG_FILE).unlink() or f, "not a MoLoRA adapter folder"),
    "bad_json": (lambda f: _do((f / ml.CONFIG_FILE).write_text("{oops"), f), "not valid JSON"),
    "format": (lambda f: _edit_meta(f, format="peft") or f, "format"),
    "version": (lambda f: _edit_meta(f, version=99) or f, "unsupported version 99"),
    "config": (lambda f: _edit_meta(f, config={"num_experts": 2, "top_k": 5}) or f, "bad config"),
    "modules": (lambda f: _edit_meta(f, modules=[]) or f, "modules"),
    "no_weights": (lambda f: (f / ml.WEIGHTS_FILE).unlink() or f, "has no molora_model.safetensors"),
    "truncated": (lambda f: _do((f / ml.WEIGHTS_FILE).write_bytes((f / ml.WEIGHTS_FILE).read_bytes()[:200]), f),
                  "damaged"),
    "other_module": (lambda f: _edit_meta(f, modules=["model.layers.7.self_attn.q_proj"]) or f, "does not exist"),
    "rank": (lambda f: _edit_meta(f, config={"num_experts": 2, "rank": 3, "target_modules": ["q_proj"]}) or f,
             "does not fit this base"),
    "tensor_names": (lambda f: _edit_meta(f, modules=["model.layers.0.self_attn.k_proj"]) or f, "lacks"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_bad_folders_are_user_errors(tiny_model_dir, tmp_path, case):
    breaker, message = BAD_FOLDERS[case]
    folder = breaker(_saved(tiny_model_dir, tmp_path / "adapter"))
    model = load_base(tiny_model_dir)
    with pytest.raises(UserError, match=message) as err:
        ml.load_molora(model, folder)
    assert one_line(err)
    assert not ml.molora_modules(model)  # nothing was attached


def test_folder_for_another_base(tiny_model_dir, tmp_path):

    folder = _saved(tiny_model_dir, tmp_path / "adapter")
    other = load_base(str(build_random_model(tmp_path / "other", hidden=32, ffn=64)))
    with pytest.raises(UserError, match="hidden size 64") as err:
        ml.load_molora(other, folder)
    assert one_line(err)
