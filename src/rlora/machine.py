"""What the machine computes fast, and the `auto` settings that follow from it.

The same command can be 3x slower on one CPU than another: a bfloat16 sampler is 1.6-2.6x faster than float32 on
CPUs with AVX512-BF16 or AMX, and ~2x slower on AVX2-only CPUs, where bf16 matmuls are emulated; there a
float32 sampler from float16 weight copies (fbgemm) is 1.5-2.3x faster instead (1.3x in demo steps on an AVX512
CPU without bf16, docs/benchmarks.md). Settings
that depend on this default to `auto`, resolved from these facts once per run, printed, and written to the
run's config.yaml as the value chosen (train/session.py: resolve_machine_settings).
"""

from __future__ import annotations

from functools import lru_cache

import torch

FP16_WEIGHT_FLAGS = ("avx2", "fma", "f16c")  # what fbgemm's float16-weight products need (x86)
HALF_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo: x86 `flags`, Arm `Features`); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_half(device: torch.device | str, half: str, flags: frozenset[str] | None = None) -> bool:
    """Does the device compute `half` ("bfloat16" | "float16") matmuls natively? GPUs: bf16 where CUDA
    says so (Ampere on), fp16 always. CPUs: AVX512-BF16/AMX-BF16 for bf16, AVX512-FP16/AMX-FP16 for fp16."""
    device = torch.device(device)
    if device.type == "cuda":  # bf16 tensor cores from Ampere (compute capability 8) on; earlier ones emulate it
        return half == "float16" or torch.cuda.get_device_capability(device)[0] >= 8
    if device.type != "cpu":
        return False  # mps and others: not measured here, so never chosen automatically
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in HALF_FLAGS[half])  # x86 names; other CPUs: never chosen automatically


def fast_fp16_weights(device: torch.device | str, flags: frozenset[str] | None = None) -> bool:
    """Does a float32 product from float16 weight copies (fbgemm, rollout/packed.py) beat plain float32 here?
    On x86 CPUs with AVX2/FMA/F16C and torch's fbgemm engine: measured 1.1-9x for few-row products and 1.5-2.3x
    for whole sampling calls on an AVX2-only CPU; 0.7-2.9x per product and 1.3x in demo steps on an AVX512 one
    without bf16 (docs/benchmarks.md). Not on GPUs (they use bf16/fp16 natively) nor on other CPUs (no fbgemm)."""
    if torch.device(device).type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    flags = cpu_flags() if flags is None else flags
    return all(flag in flags for flag in FP16_WEIGHT_FLAGS)
