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
