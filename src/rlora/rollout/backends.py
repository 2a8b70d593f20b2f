"""Choose the sampling backend for a run: the built-in engine where it supports the model, else
transformers `generate` (with a one-line notice saying why)."""

from __future__ import annotations

import torch

from rlora.config import RolloutConfig
from rlora.errors import UserError
from rlora.logging.console import info
from rlora.machine import native_half
from rlora.models.loading import DTYPES
from rlora.rollout.decoder import unsupported_reason
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import Generator, HFGenerator
from rlora.rollout.packed import packed_fp16_available


def build_generator(cfg: RolloutConfig, model, tokenizer, eos_ids: list[int], pad_id: int, max_length: int,
                    batch_size: int, keep_packs: bool = True) -> Generator:
    """keep_packs=False: the built-in engine's weight packs are made in each call and freed after it (a sampler used
    now and then, e.g. a run's evaluations, need not hold a second copy of the base through training)."""
    if cfg.engine == "builtin":
        reason = unsupported_reason(model, max_length)
        if reason is None:
            parameter = next(model.parameters())
            # `rlora train` resolves auto before this (train/session.py); elsewhere it means exact sampling
            setting = "model" if cfg.sampler_dtype == "auto" else cfg.sampler_dtype
            fp16_weights = setting == "float16_weights"
            if fp16_weights and (parameter.device.type != "cpu" or not packed_fp16_available()):
                raise UserError(f"rollout.sampler_dtype=float16_weights needs the model on an x86 CPU and torch's "
                                f"fbgemm engine (here: {parameter.device.type}, torch {torch.__version__}): set "
                                "rollout.sampler_dtype=auto")
            dtype = None if setting in ("model", "float16_weights") else DTYPES[setting]
            if dtype in (torch.bfloat16, torch.float16) and not native_half(parameter.device, setting):
                info(f"rollout.sampler_dtype={setting} on a device without native support for it: sampling "
                     "will be slower, not faster")
            # auto: merged (`rlora train` resolves it first: unmerged where a sharded base streams its layers)
            return BuiltinGenerator(tokenizer, eos_ids, pad_id, merge=cfg.merge_adapter is not False, dtype=dtype,
                                    decode="auto" if cfg.cuda_graphs else "eager", fp16_weights=fp16_weights,
                                    onednn=cfg.weight_packs, keep_packs=keep_packs)
        # generate draws each token as the engine does (rollout/generate_draw.py): think phases and the sampler's
        # log-probs (algo.sampler_is_cap, replay) work there too; only the engine's precision and merging do not
        info(f"rollout.engine=builtin does not support this model ({reason}); sampling with transformers generate "
             "in the model's dtype (rollout.sampler_dtype and merge_adapter do not apply)")
    return HFGenerator(tokenizer, eos_ids, pad_id, batch_size=batch_size)
