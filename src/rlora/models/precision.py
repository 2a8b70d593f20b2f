"""The precision of the trainer's passes (train.autocast): the model's own, or bf16 autocast.

With a bfloat16 base, peft keeps the adapters' weights in float32 and casts each adapter's input to float32:
every adapted module then keeps its own float32 copy of its input for the backward pass (seven per decoder layer
with all-linear adapters, the MLP's down projection's at the intermediate width), more than the base's own
activations. Under bf16 autocast the adapters take the bf16 activations as they are (peft's input cast off):
their matmuls run in bf16 on the tensors the base layers already keep, and autocast casts the float32 adapter
weights once per pass. The adapters' weights, gradients and optimizer state stay float32.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from peft.helpers import disable_input_dtype_casting

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16}


@contextmanager
def trainer_precision(model: torch.nn.Module, autocast: str):
    """The trainer's passes under `autocast` ('off', or a key of AUTOCAST_DTYPES, as train.autocast resolves to).
    Every pass whose log-probs are compared (reference, old, policy) must run under the same setting."""
    if autocast == "off":
        yield
        return
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=AUTOCAST_DTYPES[autocast]), disable_input_dtype_casting(model):
        yield


class SavedForBackward:
    """Counts the bytes of the distinct storages autograd saves for backward inside it: the activation memory a
    pass holds until its backward, independent of the allocator (tests/test_autocast.py, bench/autocast_memory.py)."""

    def __enter__(self) -> "SavedForBackward":
        self.bytes, self._seen = 0, set()
        self.bytes_by_dtype: dict[torch.dtype, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
            self.bytes_by_dtype[tensor.dtype] = self.bytes_by_dtype.get(tensor.dtype, 0) + storage.nbytes()
        return tensor
