"""Choose the sampling backend for a run: the built-in engine where it supports the model, else
transformers `generate` (with a one-line notice saying why)."""

from __future__ import annotations

import torch

from rlora.config import RolloutConfig
from rlora.errors import UserError
from rlora.logging.console import info
from rlora.models.loading import DTYPES
from rlora.rollout.decoder import unsupported_reason
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import Generator, HFGenerator


def _fast_half(model, dtype: torch.dtype) -> bool:
    """Half-precision matmuls are fast on GPUs, and on CPUs with AVX512-BF16/AMX (bf16) or
    AVX512-FP16/AMX-FP16 (fp16)."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        return True
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    wanted = ("avx512_bf16", "amx_bf16") if dtype == torch.bfloat16 else ("avx512_fp16", "amx_fp16")
    return any(flag in flags for flag in wanted)


def build_generator(cfg: RolloutConfig, model, tokenizer, eos_ids: list[int], pad_id: int, max_length: int,
                    batch_size: int) -> Generator:
    if cfg.engine == "builtin":
        reason = unsupported_reason(model, max_length)
        if reason is None:
            dtype = None if cfg.sampler_dtype == "model" else DTYPES[cfg.sampler_dtype]
            if dtype in (torch.bfloat16, torch.float16) and not _fast_half(model, dtype):
                info(f"rollout.sampler_dtype={cfg.sampler_dtype} on a CPU without native support for it: sampling "
                     "will be slower, not faster")
            return BuiltinGenerator(tokenizer, eos_ids, pad_id, merge=cfg.merge_adapter, dtype=dtype,
                                    decode="auto" if cfg.cuda_graphs else "eager")
        if cfg.think is not None:
            raise UserError(f"rollout.think (phase-aware sampling) needs the built-in engine, which does not support "
                            f"this model ({reason}): remove rollout.think to sample with transformers generate")
        info(f"rollout.engine=builtin does not support this model ({reason}); sampling with transformers generate "
             "(rollout.sampler_dtype and merge_adapter do not apply)")
    return HFGenerator(tokenizer, eos_ids, pad_id, batch_size=batch_size)
