"""The frozen base's linear weights packed once for a CPU kernel, each layer's LoRA unmerged beside them: the
built-in sampler's linear maps on a CPU.

Decoding a few rows is mostly weight products, and on a 2-core CPU MKL's float32 products (what `F.linear` calls)
run far below the memory bandwidth for few rows: MKL repacks the weight matrix into its kernel's layout on every
call. Two packed formats keep that layout between calls:

- OneDnnPacks (float32, or bfloat16 where the CPU computes it natively): oneDNN's blocked copy of the weights
  (`torch.ops.mkldnn`, what inductor's frozen graphs use); the same arithmetic in the same dtype as the plain
  products, another kernel (float32 rounding of the sums differs, ~1e-6 relative; in bf16 the base is rounded to
  bf16 and the LoRA runs beside it in bf16, where merging sums them in float32 and rounds once). On an AMD EPYC with
  AVX512: 1.3-3.1x MKL's speed for 16-32 rows of SmolLM2's maps, float32 sampling 1.5-1.7x faster, bf16 within
  noise (docs/benchmarks.md). The default of the float32 and bfloat16 samplers on x86 CPUs (rollout.weight_packs).
- Fp16Packs (`rollout.sampler_dtype: float16_weights`): fbgemm's float16 copy (half the bytes, converted in its
  kernel, activations and accumulation in float32): 0.26-0.68x MKL's time on an AVX2-only CPU. The sampled
  log-probs differ from the trainer's float32 ones by the float16 rounding of the weights (~1e-3 nats), which
  truncated importance sampling (algo.sampler_is_cap) corrects, as for a bfloat16 sampler.

Packing is slow (~14 ms per SmolLM2 layer matrix for fbgemm, ~50 ms for the output layer in oneDNN), so only the
frozen base is packed, once per base (PackCache), and each layer's LoRA runs unmerged beside it (two thin
products): the base never changes, the adapter changes every step. A pack is a second copy of the base's linear
weights in the sampler's dtype, kept for the run (`PackCache.clear()` frees it).
"""

from __future__ import annotations

import platform
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from rlora.machine import native_half


def packed_fp16_available() -> bool:
    """Can this torch run fbgemm's float16-weight linear (x86 builds with the fbgemm engine)?"""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized,
                                                                             "linear_prepack_fp16")


def onednn_packs_available(dtype: torch.dtype) -> bool:
    """Can this torch run oneDNN's packed linear for `dtype` on this CPU, and is it the fast choice? x86 builds with
    oneDNN; float32 always, bfloat16 only where the CPU computes it natively (elsewhere it is emulated)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available() \
            or not torch.backends.mkldnn.enabled:  # switched off by the user (e.g. torch.backends.mkldnn.flags)
        return False
    ops = ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
    if not all(hasattr(torch.ops.mkldnn, op) for op in ops):
        return False
    if dtype == torch.bfloat16:  # oneDNN's own check too: ONEDNN_MAX_CPU_ISA may hold it below the CPU's flags
        return native_half("cpu", "bfloat16") and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class Fp16Packs:
    """fbgemm's float16 weights, float32 activations and sums (x86 CPUs with AVX2/F16C)."""

    dtype = torch.float32  # of the inputs and outputs
    name = "float16 weight packs (fbgemm)"

    def accepts(self, weight_dtype: torch.dtype) -> bool:
        return weight_dtype == torch.float32

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> object:
        return torch.ops.quantized.linear_prepack_fp16(weight, bias)

    def linear(self, x_NI: torch.Tensor, packed: object) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x_NI, packed)


class OneDnnPacks:
    """oneDNN's blocked weights in `dtype` (float32, or bfloat16 where native), the products in that dtype."""

    name = "oneDNN weight packs"

    def __init__(self, dtype: torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"oneDNN weight packs hold float32 or bfloat16 weights, not {dtype}")
        self.dtype = dtype

    def accepts(self, weight_dtype: torch.dtype) -> bool:
        return weight_dtype in (torch.float32, torch.bfloat16)  # packed in self.dtype

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> object:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype).contiguous())
        return packed, None if bias is None else bias.to(self.dtype).contiguous()

    def linear(self, x_NI: torch.Tensor, packed: object) -> torch.Tensor:
        weight, bias = packed
        return torch.ops.mkldnn._linear_pointwise(x_NI.contiguous(), weight, bias, "none", [], "")


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
    """Packed copies of frozen base weights (fp16 through fbgemm by default), kept between sampling calls. An entry is
    used only while its source tensors are alive and unchanged: the same objects, version counters, storage, dtype
    and device. A write through `.data` in place (peft's merge does that) bumps no counter: call clear() after one."""

    def __init__(self, packs: Fp16Packs | OneDnnPacks | None = None):
        self.format = packs or Fp16Packs()
        self._entries: dict[tuple, tuple[list, tuple, object]] = {}

    def clear(self) -> None:
        """Drop every pack (they are made again when next used)."""
        self._entries = {}

    def packed(self, linears: list[nn.Linear]) -> object:
        tensors = [t for m in linears for t in (m.weight, m.bias) if t is not None]
        key = tuple(id(t) for t in tensors)
        versions = tuple((t._version, t.data_ptr(), t.dtype, t.device) for t in tensors)
        entry = self._entries.get(key)
        if entry is not None and all(r() is t for r, t in zip(entry[0], tensors)) and entry[1] == versions:
            return entry[2]
        # one map (o, down, the output layer) is packed from the weight itself: no concatenated copy of it first
        weight = linears[0].weight.detach() if len(linears) == 1 else torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(linears, biases)])
        self._entries = {k: e for k, e in self._entries.items() if all(r() is not None for r in e[0])}  # drop dead
        self._entries.pop(key, None)  # a changed entry's old pack goes before the new one is made
        packed = self.format.pack(weight, bias)
        self._entries[key] = ([weakref.ref(t) for t in tensors], versions, packed)
        return packed


class PackedLinear:
    """Several linear maps of the same input (q/k/v, gate/up, or one), in and out in the packs' dtype: the bases'
    fused packed copy, plus every active LoRA unmerged: one product with the adapters' A stacked and one with their
    B as a block-diagonal matrix, added to the fused output before it is split."""

    def __init__(self, parts: list[tuple[nn.Linear, list]], cache: PackCache):
        bases = [base for base, _ in parts]
        self.sizes = [b.out_features for b in bases]
        self.format = cache.format
        self.packed = cache.packed(bases)
        dtype = self.format.dtype
        A_parts, B_blocks, rank, out = [], [], 0, 0
        for (base, factors), size in zip(parts, self.sizes):
            for A_RI, B_OR, scale in factors:
                A_parts.append(A_RI.detach().to(dtype))
                B_blocks.append((out, rank, (B_OR.detach().float() * scale).to(dtype)))
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
        if any(p is None or not cache.format.accepts(p[0].weight.dtype) for p in parts):
            return None
        return cls(parts, cache)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # A row's result depends on how many rows share the product at the level of float32 accumulation order
        # (~1e-6 relative; fbgemm and oneDNN pick kernels by row count), as with MKL's float32 products (which
        # differ for fewer than 12 rows): the sampler's tests compare rows across batchings at such a tolerance.
        x_NI = x.reshape(-1, x.shape[-1])
        y_NO = self.format.linear(x_NI, self.packed)
        if self.A is not None:  # in place: the packed product's output is ours (addmm would copy it first)
            y_NO.addmm_(F.linear(x_NI, self.A), self.B.t())
        y = y_NO.view(*x.shape[:-1], y_NO.shape[-1])
        return (y,) if len(self.sizes) == 1 else y.split(self.sizes, dim=-1)
