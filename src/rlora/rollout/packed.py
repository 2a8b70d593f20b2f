"""Float32 sampling from float16 weight copies (`rollout.sampler_dtype: float16_weights`), for x86 CPUs without
native bf16 (AVX2 only).

Decoding a few rows is mostly weight products, and on a 2-core AVX2 CPU MKL's float32 products of 16 rows run far
below the cores' peak; fbgemm's float16-weight product (weights stored in half the bytes, converted in its kernel,
activations and accumulation in float32) takes 0.26-0.68x their time for SmolLM2's layers (docs/benchmarks.md).
Packing a weight for fbgemm is slow (~14 ms per SmolLM2 layer matrix), so only the frozen base is packed, once
per base (PackCache), and each layer's LoRA runs unmerged beside it in float32 (two thin products): the base
never changes, the adapter changes every step.

The sampled log-probs differ from the trainer's float32 ones by the float16 rounding of the weights (~1e-3
nats), which truncated importance sampling (algo.sampler_is_cap) corrects, as for a bfloat16 sampler.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn


def packed_fp16_available() -> bool:
    """Can this torch run fbgemm's float16-weight linear (x86 builds with the fbgemm engine)?"""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized,
                                                                             "linear_prepack_fp16")


def _plain_linear(module: nn.Module) -> nn.Linear | None:
    return module if type(module) is nn.Linear and module.weight.dtype.is_floating_point else None


def linear_parts(module: nn.Module) -> tuple[nn.Linear, list[tuple[torch.Tensor, torch.Tensor, float]]] | None:
    """(base linear, [(A [R, I], B [O, R], scale) of each active adapter]) of a floating-point linear or of a plain
    peft LoRA layer over one; None for anything else (variants such as DoRA, LoRA biases, merged or quantized
    layers), which the sampler then calls as a module: that is exactly the trainer's computation."""
    plain = _plain_linear(module)
    if plain is not None:
        return plain, []
    if not hasattr(module, "lora_A") or getattr(module, "merged", False):
        return None
    base = _plain_linear(module.get_base_layer())
    if base is None:
        return None
    if module.disable_adapters:
        return base, []
    active = [name for name in module.active_adapters if name in module.lora_A]
    if any(name in module.lora_variant or module.lora_B[name].bias is not None for name in active):
        return None
    return base, [(module.lora_A[n].weight, module.lora_B[n].weight, module.scaling[n]) for n in active]


class PackCache:
    """fbgemm-packed float16 copies of frozen base weights, kept between sampling calls. An entry is used only while
    its source tensors are alive and unchanged (same objects, same version counters)."""

    def __init__(self):
        self._entries: dict[tuple, tuple[list, tuple[int, ...], object]] = {}

    def packed(self, linears: list[nn.Linear]) -> object:
        tensors = [t for m in linears for t in (m.weight, m.bias) if t is not None]
        key = tuple(id(t) for t in tensors)
        versions = tuple(t._version for t in tensors)
        entry = self._entries.get(key)
        if entry is not None and all(r() is t for r, t in zip(entry[0], tensors)) and entry[1] == versions:
            return entry[2]
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(linears, biases)])
        packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        self._entries = {k: e for k, e in self._entries.items() if all(r() is not None for r in e[0])}  # drop dead
        self._entries[key] = ([weakref.ref(t) for t in tensors], versions, packed)
        return packed


class PackedLinear:
    """Several linear maps of the same input (q/k/v, gate/up, or one), float32 in and out: the bases' fused
    float16 copy through fbgemm, plus every active LoRA unmerged: one product with the adapters' A stacked and one
    with their B as a block-diagonal matrix, added to the fused output before it is split."""

    def __init__(self, parts: list[tuple[nn.Linear, list]], cache: PackCache):
        bases = [base for base, _ in parts]
        self.sizes = [b.out_features for b in bases]
        self.packed = cache.packed(bases)
        A_parts, B_blocks, rank, out = [], [], 0, 0
        for (base, factors), size in zip(parts, self.sizes):
            for A_RI, B_OR, scale in factors:
                A_parts.append(A_RI.detach().float())
                B_blocks.append((out, rank, B_OR.detach().float() * scale))
                rank += A_RI.shape[0]
            out += size
        self.A = torch.cat(A_parts) if A_parts else None
        self.B = None
        if A_parts:
            self.B = self.A.new_zeros(out, rank)
            for row, col, B_OR in B_blocks:
                self.B[row:row + B_OR.shape[0], col:col + B_OR.shape[1]] = B_OR

    @classmethod
    def of(cls, modules: list[nn.Module], cache: PackCache) -> "PackedLinear | None":
        """The packed map of these modules, or None where one of them must be called as a module."""
        parts = [linear_parts(m) for m in modules]
        if any(p is None or p[0].weight.dtype != torch.float32 for p in parts):  # packs hold float32 bases only
            return None
        return cls(parts, cache)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # A row's result depends on how many rows share the product at the level of float32 accumulation order
        # (~1e-6 relative; fbgemm picks kernels by row count), as with MKL's float32 products (which differ for
        # fewer than 12 rows): the sampler's tests compare rows across batchings at such a tolerance.
        x_NI = x.reshape(-1, x.shape[-1])
        y_NO = torch.ops.quantized.linear_dynamic_fp16(x_NI, self.packed)
        if self.A is not None:
            y_NO = torch.addmm(y_NO, F.linear(x_NI, self.A), self.B.t())
        y = y_NO.view(*x.shape[:-1], y_NO.shape[-1])
        return (y,) if len(self.sizes) == 1 else y.split(self.sizes, dim=-1)
