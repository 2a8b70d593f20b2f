"""`rlora merge ADAPTER`: fold a LoRA adapter into its base model and save a plain Hugging Face folder
(config, safetensors weights, tokenizer) that transformers loads without peft and that inference servers
can serve. The merge is done in float32 (or the chosen dtype) on a fresh copy of the base; the adapter
folder and the base folder are only read."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from peft import PeftModel

from rlora.config import ModelConfig
from rlora.errors import UserError, first_line
from rlora.models.loading import check_adapter_folder, load_base_model, load_tokenizer, resolve_model_path
from rlora.models import molora as ml
from rlora.models.named_adapters import is_molora_folder, recorded_base
from rlora.system import as_if_created
from rlora.train.outputs import check_merge_output


def adapter_base(adapter: str, base: str | None) -> str:
    """The base model folder: --base if given, else the adapter's own base_model_name_or_path."""
    if base is not None:
        return resolve_model_path(base, "--base")
    recorded = recorded_base(adapter)
    if not recorded:
        raise UserError(f"adapter '{adapter}' does not name its base model: pass --base MODEL")
    return resolve_model_path(recorded, "the adapter's base")


def refuse_molora(adapter: str) -> None:
    """A MoLoRA folder has no single merged weight: its router mixes the experts per sequence or per token."""
    if is_molora_folder(adapter):
        _, config = ml.read_molora_meta(adapter)
        unit = "sequence (from its prompt)" if config.router == "sequence" else "token"
        raise UserError(f"adapter '{adapter}' is a MoLoRA mixture: its router mixes {config.num_experts} experts per "
                        f"{unit}, so it is not one fixed weight to fold into the base; use it with rlora eval / chat")


def _untie_embeddings(model) -> bool:
    """Give a tied output layer's base weight its own copy of the embeddings (and say so in the config) -> whether
    they were tied. Done on the loaded peft model, just before the merge: peft reads the tie when it loads the adapter
    (trainable tokens on a tied base are tied on both sides), and the merge then folds each side's delta into that
    side's own tensor; folded into one shared tensor, a LoRA on either side (rlora serve's train_unembed puts one
    on the output layer) would move the other side too."""
    outputs = model.get_output_embeddings()  # first: some remote-code models have no input embeddings to ask for
    if outputs is None:
        return False
    inputs = model.get_input_embeddings()
    out_base, in_base = getattr(outputs, "base_layer", outputs), getattr(inputs, "base_layer", inputs)
    if out_base.weight is not in_base.weight:
        return False
    out_base.weight = torch.nn.Parameter(in_base.weight.detach().clone())
    _set_tied(model, False)
    return True


def _retie_if_equal(model) -> None:
    """Tie the two sides again where the adapter changed neither (the saved folder then holds one copy, as before)."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if torch.equal(inputs.weight, outputs.weight):
        outputs.weight = inputs.weight
        _set_tied(model, True)


def _set_tied(model, tied: bool) -> None:
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = tied


def merge_adapter(adapter: str, output: str, base: str | None = None, dtype: str = "float32",
                  overwrite: bool = False) -> Path:
    refuse_molora(adapter)
    check_adapter_folder(adapter, key="adapter")
    check_merge_output(output, overwrite)
    target = Path(output)
    base_path = adapter_base(adapter, base)
    tokenizer, _ = load_tokenizer(base_path)
    model = load_base_model(ModelConfig(path=base_path, dtype=dtype), base_path)
    try:
        peft_model = PeftModel.from_pretrained(model, adapter)
        tied = _untie_embeddings(peft_model.get_base_model())
        merged = peft_model.merge_and_unload()
    except Exception as err:  # noqa: BLE001 - an adapter for another base, broken weights ...
        raise UserError(f"adapter '{adapter}' does not fit model '{base_path}': {first_line(err)}") from None
    if tied:
        _retie_if_equal(merged)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        as_if_created(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
