"""A second device on a CPU-only machine, for tests: which tensors would live on the model's accelerator, and
which on the host, tracked while code runs, so that code which would mix them on a GPU fails here too.

On a GPU, an op that mixes a CUDA tensor with a CPU tensor of more than one element raises; on a CPU nothing
can tell them apart. `SimulatedDevice` (a TorchFunctionMode) tags tensors as on the device: the model's
parameters and buffers, tensors made with an explicit device (`device=...`, `.to(device)`, `new_*`, `*_like` of
a device tensor), and every result of an op with a device tensor among its inputs. Everything else is on the
host: `torch.tensor(list)`, factories without a device, `.cpu()`, `.to("cpu")`. It records (`mixed`) each op
that CUDA would refuse: a device tensor beside a host tensor of more than one element (0-dim host tensors mix
freely, as on CUDA; a host index into a device tensor is allowed, a device index into a host tensor is not).
It also records the transfers of large tensors between the two (`to_host`, `to_device`).

What it cannot see: an explicit `device="cpu"` given as a torch.device (it counts as the device, so host
tensors made that way are missed, never falsely flagged), and ops inside C++ or inside a function it already
looked at (only the outermost torch call of each Python statement is checked)."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

_GETITEM = {torch.Tensor.__getitem__}
_SETITEM = {torch.Tensor.__setitem__}
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__float__,
            torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}
_COPY = {torch.Tensor.copy_}
_FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.rand, torch.randn, torch.randint,
              torch.tensor, torch.as_tensor, torch.eye, torch.linspace}
_LIKE = {torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.rand_like, torch.randn_like}
_NEW = {torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full, torch.Tensor.new_empty,
        torch.Tensor.new_tensor}
# reads of metadata, not of data: never a mix
_META = {torch._has_compatible_shallow_copy_type, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__, torch.Tensor.stride,
         torch.Tensor.is_contiguous, torch.Tensor.data_ptr, torch.Tensor.element_size}


@dataclass
class Transfer:
    what: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str


@dataclass
class SimulatedDevice(TorchFunctionMode):
    mixed: list[str] = field(default_factory=list)
    to_host: list[Transfer] = field(default_factory=list)
    to_device: list[Transfer] = field(default_factory=list)
    placed: bool = False  # place() was called: something is on the device
    recording: bool = True  # record transfers (mixes are always recorded)

    def __post_init__(self):
        super().__init__()
        self._on_device = WeakIdKeyDictionary()
        self._devices: dict[int, torch.device] = {}  # torch.device objects read off device tensors (.device)

    def place(self, *modules_or_tensors) -> "SimulatedDevice":
        """Put these modules' parameters and buffers (or these tensors) on the device."""
        self.placed = True
        for item in modules_or_tensors:
            tensors = list(item.parameters()) + list(item.buffers()) if isinstance(item, torch.nn.Module) else [item]
            for tensor in tensors:
                self._on_device[tensor] = True
        return self

    def on_device(self, tensor: torch.Tensor) -> bool:
        # a parameter lives with the model (adapters attached after `place` included)
        return isinstance(tensor, torch.nn.Parameter) or tensor in self._on_device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in _tensors(args) + _tensors(kwargs) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        device_in = [t for t in inputs if self.on_device(t)]
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: a device tensor's .grad, .T, .data ... is on the device
            if device_in and isinstance(out, torch.device):  # each access makes a new object: remember it
                self._devices[id(out)] = out
            elif device_in:
                self._tag(out)
            return out
        if func in _META or name == "__set__":
            return out
        if func in _TO_HOST:
            if device_in:
                self._transfer(self.to_host, func, device_in[0])
            # on a CPU .cpu() returns the tensor itself; on a GPU a new one: copy, so that the host one is apart
            return out.clone() if func is torch.Tensor.cpu and out is args[0] and device_in else out
        if func is torch.Tensor.to:
            target = self._target(args[1:], kwargs)
            if target == "host":
                if device_in:
                    self._transfer(self.to_host, func, device_in[0])
                return out.clone() if out is args[0] and device_in else out
            if target == "device" or (target == "follow" and self.on_device(_tensors(args[1:2] + (kwargs.get("other"),))[0])):
                if not self.on_device(args[0]):
                    self._transfer(self.to_device, func, args[0])
                    out = out.clone() if out is args[0] else out  # the host tensor stays on the host
                self._tag(out)
            elif device_in:  # a dtype change stays where it is
                self._tag(out)
            return out
        if func in _FACTORIES:
            if self._device_given(kwargs):
                self._tag(out)
            return out
        if func in _LIKE or func in _NEW:
            if self._device_given(kwargs) or (inputs and self.on_device(inputs[0]) and "device" not in kwargs):
                self._tag(out)
            return out
        if func in _COPY:  # a copy between devices is allowed; the destination keeps its place
            if self.on_device(args[0]) and not self.on_device(args[1]) and args[1].numel() > 1:
                self._transfer(self.to_device, func, args[1])
            if not self.on_device(args[0]) and self.on_device(args[1]) and args[1].numel() > 1:
                self._transfer(self.to_host, func, args[1])
            return out
        if func in _GETITEM or func in _SETITEM:
            base = args[0]
            indices = _tensors(args[1:2])
            if not self.on_device(base) and any(self.on_device(i) for i in indices):
                self._mix(func, "a device index into a host tensor")
            if func in _SETITEM and self.on_device(base):
                values = _tensors(args[2:3])
                if any(not self.on_device(v) and v.dim() > 0 for v in values):
                    self._mix(func, "host values written into a device tensor")
            if func in _GETITEM and self.on_device(base):
                self._tag(out)
            return out
        host_in = [t for t in inputs if not self.on_device(t) and t.dim() > 0]
        if device_in and host_in:
            shapes = [tuple(t.shape) for t in host_in]
            self._mix(func, f"host tensors {shapes} beside device tensors")
        if device_in:
            self._tag(out)
        return out

    def _is_device(self, device) -> bool:
        """A device argument that names the simulated device: one read off a device tensor, or a non-CPU name."""
        if isinstance(device, str):
            return not device.startswith("cpu")
        return isinstance(device, torch.device) and id(device) in self._devices

    def _device_given(self, kwargs) -> bool:
        return self._is_device(kwargs.get("device"))

    def _target(self, args, kwargs) -> str | None:
        """Where .to(...) goes: 'device', 'host', 'follow' (to(other): other's place) or None (a dtype only)."""
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, torch.Tensor):
            return "follow"
        if isinstance(target, (str, torch.device)):
            return "device" if self._is_device(target) else "host"
        return None

    def _tag(self, out) -> None:
        for tensor in _tensors(out):
            if isinstance(tensor, torch.Tensor):
                self._on_device[tensor] = True

    def _mix(self, func, what: str) -> None:
        self.mixed.append(f"{_name(func)}: {what}\n{_caller()}")

    def _transfer(self, transfers: list[Transfer], func, tensor: torch.Tensor) -> None:
        if self.recording:
            transfers.append(Transfer(_name(func), tuple(tensor.shape), tensor.dtype, _caller()))


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _name(func) -> str:
    return getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))


def _caller() -> str:
    """The innermost frame in rlora's source that led here."""
    frames = [f for f in traceback.extract_stack() if "/rlora/" in f.filename and "/tests/" not in f.filename]
    return "" if not frames else f"  at {frames[-1].filename.split('/src/')[-1]}:{frames[-1].lineno}: {frames[-1].line}"
