"""What `rlora serve` keeps: ids, tinker:// paths and the saved adapters under --state-dir.

Ids follow the SDK's own derivations (it computes a training client's model id itself when it creates one
from saved weights): a model is `SESSION:train:N`, a sampler `SESSION:sample:N`. A saved adapter is a plain
PEFT folder (adapter_config.json + adapter_model.safetensors, safetensors only: no pickle anywhere):

    STATE_DIR/models/<model key>/sampler_weights/<name>/      save_weights_for_sampler(name)
    STATE_DIR/models/<model key>/weights/<name>/              save_weights (save_state): the adapter, and its AdamW
                                                               state in optimizer.safetensors + optimizer.json
    tinker://<model id>/<sampler_weights|weights>/<name>       the path the SDK gets back

A save with `ttl_seconds` (Tinker's bounds: 1 hour to 10 years) writes expires.json beside the adapter: once that time
has passed the folder is deleted where it is next used (a 404 that says it expired) and at the server's start.

A snapshot without a name (save_weights_and_get_sampling_client) stays in memory (Snapshot.tensors): an RL loop
takes one per step and never names it, so writing each to disk would fill it.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from rlora.errors import UserError
from rlora.system import as_if_created
from rlora.train.outputs import fsync_path

SCHEME = "tinker://"
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # one path segment: no '/', no '..'
KINDS = ("sampler_weights", "weights")  # a sampler's adapter; a training client's adapter and optimizer state
OPTIMIZER_FORMAT = "rlora-serve-adamw"
EXPIRY_FILE = "expires.json"
TTL_RANGE_S = (3600, 10 * 365 * 24 * 3600)  # Tinker's: one hour to ten years


def check_ttl(ttl_seconds: int | None, what: str) -> None:
    """A save's ttl_seconds: None (never expires) or Tinker's range, else a 400."""
    if ttl_seconds is not None and not TTL_RANGE_S[0] <= ttl_seconds <= TTL_RANGE_S[1]:
        raise ServeError(400, f"{what}: ttl_seconds={ttl_seconds} is outside {TTL_RANGE_S[0]} (1 hour) .. "
                              f"{TTL_RANGE_S[1]} (10 years); leave it unset for a checkpoint that never expires")


class ServeError(Exception):
    """A request the server refuses: its HTTP status and a one-line message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def check_name(name: str, what: str = "name") -> str:
    if not NAME.fullmatch(name):
        raise ServeError(400, f"{what} '{name}' is not usable: letters, digits, '_', '-', '.' (up to 128, "
                              "not starting with '.' or '-')")
    return name


def model_key(model_id: str) -> str:
    """The folder name of a model id (ids hold ':'); one that would name a folder above it is refused."""
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", model_id)
    if key.strip(".") == "":
        raise ServeError(400, f"model id '{model_id}' is not usable in a path")
    return key


def sampler_path(model_id: str, name: str) -> str:
    return f"{SCHEME}{model_id}/sampler_weights/{name}"


def weights_path(model_id: str, name: str) -> str:
    return f"{SCHEME}{model_id}/weights/{name}"


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str  # one of KINDS
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"


def parse_path(path: str) -> TinkerPath:
    """tinker://MODEL_ID/KIND/NAME -> its parts (checked: no path escapes the state folder)."""
    parts = path[len(SCHEME):].split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or not parts[0]:
        raise ServeError(400, f"'{path}' is not a tinker path (tinker://MODEL_ID/sampler_weights/NAME or .../weights/NAME)")
    model_id, kind, name = parts
    if kind not in KINDS:
        raise ServeError(400, f"'{path}': rlora serve keeps {' and '.join(KINDS)} checkpoints, not '{kind}'")
    return TinkerPath(model_id, kind, check_name(name))


_SNAPSHOTS = itertools.count()


@dataclass
class Snapshot:
    """An adapter's weights at one moment: a PEFT folder on disk, or tensors in memory (unnamed snapshots)."""

    config: LoraConfig
    folder: Path | None = None
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    key: int = field(default_factory=lambda: next(_SNAPSHOTS))  # names it among the loaded adapters

    def weights(self) -> dict[str, torch.Tensor]:
        if self.tensors is not None:
            return self.tensors
        file = self.folder / "adapter_model.safetensors"
        if not file.is_file():  # a sampling session outlived its checkpoint (its ttl passed, or it was removed)
            raise ServeError(404, f"{self.folder} is gone (its ttl_seconds passed, or it was removed): save the "
                                  "weights again and open a new sampling session")
        return load_file(str(file))


class StateDir:
    """The --state-dir folder: created on start, checked writable."""

    def __init__(self, root: str | Path, clock: Callable[[], float] = time.time):
        self.root = Path(root).expanduser().resolve()
        self.clock = clock  # seconds since the epoch: what expiry times are compared with
        try:
            (self.root / "models").mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root):
                pass
        except OSError as err:
            raise UserError(f"--state-dir '{root}' is not a writable folder: {err.strerror or err}") from None
        self.remove_expired()

    def remove_expired(self) -> list[Path]:
        """Delete every saved folder whose ttl has passed -> their folders."""
        gone = [expiry for expiry in self.root.glob(f"models/*/*/*/{EXPIRY_FILE}")
                if self._expired(expiry.parent) is not None]
        for expiry in gone:
            shutil.rmtree(expiry.parent, ignore_errors=True)
        return [expiry.parent for expiry in gone]

    def _expired(self, folder: Path) -> float | None:
        """The expiry time of a folder whose ttl has passed (None: it has none, or it has not passed)."""
        try:
            expires_at = float(json.loads((folder / EXPIRY_FILE).read_text())["expires_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return expires_at if expires_at <= self.clock() else None

    def _live(self, path: TinkerPath) -> Path:
        """The folder of `path`, recovered after a crash; one whose ttl has passed is deleted and answered with 404."""
        folder = _recovered(self.folder(path))
        expired_at = self._expired(folder)
        if expired_at is not None:
            shutil.rmtree(folder, ignore_errors=True)
            when = datetime.fromtimestamp(expired_at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            raise ServeError(404, f"{path} expired at {when} (the ttl_seconds it was saved with)")
        return folder

    def folder(self, path: TinkerPath) -> Path:
        return self.root / "models" / model_key(path.model_id) / path.kind / path.name

    def exists(self, path: TinkerPath) -> bool:
        try:
            return self._live(path).exists()
        except ServeError:  # expired: deleted, so no longer there
            return False

    def save_adapter(self, path: TinkerPath, config: LoraConfig, tensors: dict[str, torch.Tensor],
                     base_model: str, optimizer: tuple[dict[str, torch.Tensor], dict] | None = None,
                     ttl_seconds: int | None = None) -> Path:
        """A plain PEFT folder (with the optimizer's tensors and description beside it, if given), swapped in
        whole, as rlora's training checkpoints are (train/checkpoint.py): written to a temporary folder beside
        it and fsynced; an older folder of that name is set aside (`.old-NAME`), the new one renamed into
        place, the parent fsynced, and only then the old one deleted. A crash at any moment leaves the old
        folder or the new one, never neither: one left aside is put back when the path is next used."""
        target = _recovered(self.folder(path))
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{path.name}."))
        aside = target.parent / f".old-{path.name}"
        try:
            save_file(_cpu(tensors), str(temp / "adapter_model.safetensors"))
            config = copy.deepcopy(config)
            config.base_model_name_or_path = base_model
            config.save_pretrained(str(temp))
            if optimizer is not None:
                save_file(_cpu(optimizer[0]), str(temp / "optimizer.safetensors"))
                (temp / "optimizer.json").write_text(json.dumps({"format": OPTIMIZER_FORMAT, **optimizer[1]}, indent=1))
            if ttl_seconds is not None:
                (temp / EXPIRY_FILE).write_text(json.dumps({"expires_at": self.clock() + ttl_seconds}))
            for file in temp.iterdir():
                fsync_path(file)
            fsync_path(temp)
            if target.exists():
                target.rename(aside)
                fsync_path(target.parent)
            as_if_created(temp)
            os.replace(temp, target)
            fsync_path(target.parent)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return target

    def snapshot(self, path: TinkerPath, kind: str) -> Snapshot:
        """The saved adapter at `path`, which must be of `kind` (its config read; its weights when it is loaded)."""
        if path.kind != kind:
            use = ("a sampler takes sampler_weights (save_weights_for_sampler writes them)" if kind == "sampler_weights"
                   else "load_weights takes weights (save_state writes them)")
            raise ServeError(400, f"{path} is a {path.kind} checkpoint: {use}")
        folder = self._live(path)
        if not (folder / "adapter_config.json").is_file() or not (folder / "adapter_model.safetensors").is_file():
            raise ServeError(404, f"no saved weights at {path}")
        try:
            config = LoraConfig.from_pretrained(str(folder))
        except Exception as err:  # noqa: BLE001 - a damaged or foreign folder
            raise ServeError(400, f"{folder} is not a LoRA adapter folder: {err}") from None
        return Snapshot(config, folder=folder)

    def optimizer_state(self, path: TinkerPath) -> tuple[dict[str, torch.Tensor], dict]:
        """The AdamW state saved beside a training client's adapter: its tensors and its description."""
        folder = self._live(path)
        try:
            meta = json.loads((folder / "optimizer.json").read_text())
            tensors = load_file(str(folder / "optimizer.safetensors")) if meta.get("stepped") else {}
        except (OSError, ValueError) as err:
            raise ServeError(400, f"{path} holds no readable optimizer state ({err})") from None
        if meta.get("format") != OPTIMIZER_FORMAT:
            raise ServeError(400, f"{folder}/optimizer.json is not rlora serve's optimizer state")
        return tensors, meta


def _recovered(target: Path) -> Path:
    """target, with a folder a crash left set aside (save_adapter) put back if none replaced it."""
    aside = target.parent / f".old-{target.name}"
    if aside.exists():
        if target.exists():  # the swap completed; only deleting the old one did not
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.rename(target)
    return target


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}

