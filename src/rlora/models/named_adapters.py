"""Several LoRA adapters on one copy of a base, by name (`rlora eval`, `rlora chat`): parsing
`--adapter [NAME=]PATH`, loading every adapter onto the base, and switching between them (or off).
A MoLoRA folder (docs/molora.md) is loaded alone: the mixture on, or off for the base."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path

from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer

from rlora.errors import UserError, first_line
from rlora.models import expert_lora
from rlora.models import molora as ml
from rlora.models.loading import check_adapter_folder

NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # peft keeps adapters in module dicts: no '.'
# peft warns about adapter names found inside its 'lora_' parameter prefix ('a', 'o', 'ra' ...): prefix them
PEFT_NAME = "named_{}"


def parse_named_adapters(specs: list[str], reserved: tuple[str, ...] = ()) -> dict[str, str]:
    """['NAME=PATH' or 'PATH', ...] -> {name: path}. A bare PATH (or any text that is an existing path:
    paths may hold '=', names may not) is named after its folder, or its run folder for .../adapter, with
    other characters than letters, digits, '_' and '-' made '_'. Each folder is checked to be a LoRA adapter."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, _, path = ("", "", spec) if Path(spec).exists() or "=" not in spec else spec.partition("=")
        if not name:
            folder = Path(path.rstrip("/"))
            name = re.sub(r"[^A-Za-z0-9_-]", "_", folder.parent.name if folder.name == "adapter" else folder.name)
        if not NAME.match(name) or name in reserved:
            reserved_text = f" (and not {', '.join(reserved)})" if reserved else ""
            raise UserError(f"--adapter name '{name}' is not usable: give NAME=PATH with NAME of letters, digits, "
                            f"'_', '-'{reserved_text}")
        if name in adapters:
            raise UserError(f"--adapter: the name '{name}' is given twice (name them: --adapter NAME=PATH)")
        check_lora_folder(path)
        adapters[name] = path
    return adapters


def _adapter_config(folder: str) -> dict:
    return json.loads((Path(folder) / "adapter_config.json").read_text())


def is_molora_folder(folder: str) -> bool:
    return (Path(folder) / ml.CONFIG_FILE).is_file()


def check_lora_folder(folder: str) -> None:
    """A LoRA adapter folder, or a MoLoRA folder (its description checked)."""
    path = Path(folder)
    if not path.exists():
        raise UserError(f"--adapter '{folder}' not found")
    if not (path / "adapter_config.json").is_file() and not is_molora_folder(folder):
        _refuse_run_folder(path)
    if is_molora_folder(folder):
        ml.read_molora_meta(folder)
        return
    check_adapter_folder(folder, key="--adapter")
    kind = _adapter_config(folder).get("peft_type")
    if kind != "LORA":
        raise UserError(f"--adapter '{folder}' is a {kind} adapter: rlora loads LoRA adapters only")


def _refuse_run_folder(run: Path) -> None:
    """The output folder of `rlora train` holds its adapter (or each policy's) a level down: name the one to give,
    rather than only that this folder is not an adapter."""
    if _is_adapter(run / "adapter"):
        raise UserError(f"--adapter '{run}' is a run folder: give its adapter, --adapter {run / 'adapter'}")
    policies = sorted(p for p in (run / "policies").glob("*/adapter") if _is_adapter(p))
    if policies:
        raise UserError(f"--adapter '{run}' is a run of several policies: give each policy's adapter, e.g. "
                        f"--adapter {policies[0].parent.name}={policies[0]}")


def _is_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file() or is_molora_folder(str(folder))


def recorded_base(folder: str) -> str | None:
    """The base model an adapter folder names in its adapter_config.json or molora_config.json (None: none)."""
    if is_molora_folder(folder):
        return ml.read_molora_meta(folder)[0].get("base_model") or None
    return _adapter_config(folder).get("base_model_name_or_path") or None


def _attach_molora(base, adapters: dict[str, str], model_label: str):
    """The one MoLoRA folder among `adapters` onto the base (alone: its layers replace the base's linear layers,
    where peft adapters would sit)."""
    if len(adapters) > 1:
        raise UserError(f"a MoLoRA adapter is loaded alone: give it as the only --adapter (got {len(adapters)}: "
                        f"{', '.join(adapters)}); evaluate the others in another run")
    [folder] = adapters.values()
    try:
        ml.load_molora(base, folder)
    except UserError as err:
        raise UserError(f"adapter '{folder}' does not fit model '{model_label}': {err}") from None
    base.eval()
    return base


def attach_named(base, adapters: dict[str, str], model_label: str):
    """Every adapter onto the one base (peft named adapters), in eval mode; the base itself when there are
    none. An adapter that does not fit (another base: shapes or module names differ) -> UserError."""
    if any(is_molora_folder(folder) for folder in adapters.values()):
        return _attach_molora(base, adapters, model_label)
    model = base
    for name, folder in adapters.items():
        try:
            if model is base:
                model = PeftModel.from_pretrained(base, folder, adapter_name=PEFT_NAME.format(name))
            else:
                model.load_adapter(folder, adapter_name=PEFT_NAME.format(name))
        except Exception as err:  # noqa: BLE001 - an adapter for another base, broken weights ...
            if "target_parameters" in str(err):  # it fits the base, not the other adapters
                raise UserError(f"adapter '{folder}' cannot load beside the others: peft loads adapters of a mixture's "
                                f"expert parameters together only where they adapt the same ones ({first_line(err)})"
                                ) from None
            raise UserError(f"adapter '{folder}' does not fit model '{model_label}': {first_line(err)}") from None
    model.eval()
    expert_lora.install(model)
    return model


@contextmanager
def activated(model, name: str | None):
    """The model with adapter `name` active; None: every adapter switched off (the plain base)."""
    if ml.has_molora(model):
        with (ml.molora_disabled(model) if name is None else nullcontext()):
            yield model
    elif not hasattr(model, "peft_config"):
        yield model
    elif name is None:
        with model.disable_adapter():
            yield model
    else:
        model.set_adapter(PEFT_NAME.format(name), inference_mode=True)
        yield model


@contextmanager
def kept_flags(model):
    """Put back every parameter's requires_grad and every module's training flag afterwards (peft's
    set_adapter changes both)."""
    grads = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for param, requires_grad in grads:
            param.requires_grad_(requires_grad)
        for module, training in modes:
            module.training = training


@contextmanager
def adapter_switched(model, name: str, trainable: bool = False):
    """The peft model with adapter `name` active (its parameters requiring grad if `trainable`), then the
    adapter that was active before, with every requires_grad and training flag as it was. Anything that
    runs the adapter (a backward pass that recomputes checkpointed activations included) must run inside. Beside a
    MoLoRA policy the mixture is off inside: the adapter runs on the base alone, as one beside a LoRA policy does
    once the switch has turned that one off (models/beside_mixture.py)."""
    previous = model.active_adapter
    disabled = adapters_disabled(model)  # inside peft's disable_adapter() (`rlora eval` scoring the base's samples)
    mixture = ml.molora_disabled(model) if ml.has_molora(model) else nullcontext()
    with kept_flags(model), mixture:
        if disabled:
            model.base_model.enable_adapter_layers()
        model.set_adapter(name, inference_mode=not trainable)
        try:
            yield model
        finally:
            model.set_adapter(previous)
            if disabled:
                model.base_model.disable_adapter_layers()


def adapters_disabled(model) -> bool:
    """Whether peft's adapter layers are switched off (disable_adapter())."""
    return any(m.disable_adapters for m in model.modules() if isinstance(m, BaseTunerLayer))
