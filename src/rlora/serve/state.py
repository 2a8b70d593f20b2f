"""What `rlora serve` keeps: ids, tinker:// paths and the saved adapters under --state-dir.

Ids follow the SDK's own derivations (it computes a training client's model id itself when it creates one
from saved weights): a model is `SESSION:train:N`, a sampler `SESSION:sample:N`. A saved adapter is a plain
PEFT folder (adapter_config.json + adapter_model.safetensors, safetensors only: no pickle anywhere):

    STATE_DIR/models/<model key>/sampler_weights/<name>/      save_weights_for_sampler(name)
    tinker://<model id>/sampler_weights/<name>                 the path the SDK gets back

A snapshot without a name (save_weights_and_get_sampling_client) stays in memory (Snapshot.tensors): an RL loop
takes one per step and never names it, so writing each to disk would fill it.
"""

from __future__ import annotations

import copy
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from rlora.errors import UserError

SCHEME = "tinker://"
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # one path segment: no '/', no '..'
KINDS = {"sampler_weights": "sampler"}  # the checkpoint kinds this slice serves (training state: not yet)


class ServeError(Exception):
    """A request the server refuses: its HTTP status and a one-line message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def check_name(name: str, what: str = "name") -> str:
    if not NAME.match(name) or name in (".", ".."):
        raise ServeError(400, f"{what} '{name}' is not usable: letters, digits, '_', '-', '.' (up to 128, "
                              "not starting with '.' or '-')")
    return name


def model_key(model_id: str) -> str:
    """The folder name of a model id (ids hold ':')."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", model_id)


def sampler_path(model_id: str, name: str) -> str:
    return f"{SCHEME}{model_id}/sampler_weights/{name}"


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str  # a key of KINDS
    name: str


def parse_path(path: str) -> TinkerPath:
    """tinker://MODEL_ID/KIND/NAME -> its parts (checked: no path escapes the state folder)."""
    parts = path[len(SCHEME):].split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or not parts[0]:
        raise ServeError(400, f"'{path}' is not a tinker path (tinker://MODEL_ID/sampler_weights/NAME)")
    model_id, kind, name = parts
    if kind not in KINDS:
        raise ServeError(400, f"'{path}': rlora serve keeps {', '.join(KINDS)} checkpoints, not '{kind}'")
    return TinkerPath(model_id, kind, check_name(name))


@dataclass
class Snapshot:
    """An adapter's weights at one moment: a PEFT folder on disk, or tensors in memory (unnamed snapshots)."""

    config: LoraConfig
    folder: Path | None = None
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def weights(self) -> dict[str, torch.Tensor]:
        if self.tensors is not None:
            return self.tensors
        return load_file(str(self.folder / "adapter_model.safetensors"))


class StateDir:
    """The --state-dir folder: created on start, checked writable."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        try:
            (self.root / "models").mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root):
                pass
        except OSError as err:
            raise UserError(f"--state-dir '{root}' is not a writable folder: {err.strerror or err}") from None

    def folder(self, path: TinkerPath) -> Path:
        return self.root / "models" / model_key(path.model_id) / path.kind / path.name

    def save_adapter(self, path: TinkerPath, config: LoraConfig, tensors: dict[str, torch.Tensor],
                     base_model: str) -> Path:
        """A plain PEFT folder, swapped in whole (written to a temporary folder beside it, then renamed)."""
        target = self.folder(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{path.name}."))
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                      str(temp / "adapter_model.safetensors"))
            config = copy.deepcopy(config)
            config.base_model_name_or_path = base_model
            config.save_pretrained(str(temp))
            if target.exists():
                shutil.rmtree(target)
            temp.rename(target)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return target

    def snapshot(self, path: TinkerPath) -> Snapshot:
        """The saved adapter at `path` (its config read; its weights read when it is loaded)."""
        folder = self.folder(path)
        if not (folder / "adapter_config.json").is_file() or not (folder / "adapter_model.safetensors").is_file():
            raise ServeError(404, f"no saved weights at {SCHEME}{path.model_id}/{path.kind}/{path.name}")
        try:
            config = LoraConfig.from_pretrained(str(folder))
        except Exception as err:  # noqa: BLE001 - a damaged or foreign folder
            raise ServeError(400, f"{folder} is not a LoRA adapter folder: {err}") from None
        return Snapshot(config, folder=folder)

