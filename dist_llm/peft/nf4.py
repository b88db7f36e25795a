"""4-bit NormalFloat (NF4) storage for frozen linear weights, as in QLoRA (Dettmers et al., 2023).

QLoRA keeps the frozen base model in 4 bits so that only the small LoRA adapters need full precision. A
weight is cut into blocks of `block_size` (64) consecutive values; each block keeps its absmax and every
value becomes the index of the nearest of 16 NormalFloat levels (quantiles of a normal distribution,
scaled to [-1, 1]) times that absmax. The absmaxes themselves are "double quantised": their mean is
subtracted and they are stored as int8 in groups of `scale_block_size` (256), each group with one fp32
factor. That costs 4 + 8/64 + 32/(64*256) ~= 4.127 bits per weight instead of 16 or 32.

The algorithm matches torchao's `to_nf4` step for step (same absmax, mean, int8 rounding and clamping, same
nearest-level search and nibble order), so given the same 16-entry table the dequantised weight is bitwise
equal to torchao's in fp32. Two documented differences:

* torchao hard-codes the table rounded to 4 decimals (-0.6962, ...); `NF4_CODE` here holds the published
  values (bitsandbytes / the paper). Dequantised weights then differ by at most 5e-5 x the block scale, and a
  value lying within that distance of the midpoint between two levels may pick the other level.
* torchao quantises in the weight's own dtype (bf16 arithmetic for a bf16 weight, fp32 for fp32); here the
  arithmetic is always fp32 and the scale metadata is fp32 as the paper stores it, then cast to the compute
  dtype. For a bf16 weight that equals torchao run on the weight upcast to fp32, cast back to bf16.

Shapes need no divisibility: the flattened weight is padded with zeros to whole blocks (zeros change no
absmax) and the last group of scales may be short (the padding there is the mean, which quantises to 0 and
changes no group absmax). For shapes that torchao accepts (numel divisible by block_size*scale_block_size)
nothing is padded and the results are identical.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dist_llm.model.buffers import apply_keeping_fp32

#: The 16 NF4 levels from the QLoRA paper / bitsandbytes, ascending; index 7 is an exact zero.
NF4_CODE: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

# Values per nearest-level search: bounds the (chunk, 16) distance matrix at 64 MiB of fp32.
_SEARCH_CHUNK = 1 << 20


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _code_tensor(code: Sequence[float] | Tensor | None, device: torch.device) -> Tensor:
    table = torch.as_tensor(NF4_CODE if code is None else code, dtype=torch.float32, device=device).detach()
    if table.shape != (16,):
        raise ValueError(f"a 4-bit code needs exactly 16 levels, got shape {tuple(table.shape)}")
    if not torch.isfinite(table).all():
        raise ValueError("the code levels must be finite")
    return table.clone()


@dataclasses.dataclass(frozen=True)
class NF4Weight:
    """A tensor in NF4 with double-quantised block scales. Build it with `NF4Weight.quantize`.

    Block `b`'s scale is `scale_q[b] / scale_factor[b // scale_block_size] + scale_mean` and value `i` is
    `code[index_i] * scale[i // block_size]`. `scale_factor` is 128 / (the group's largest |absmax - mean|),
    the multiplier that was used to quantise (torchao stores the same number and divides by it).
    """

    packed: Tensor
    """uint8, two level indices per byte (even element in the high nibble), padded to whole blocks."""
    scale_q: Tensor
    """int8, one per block of `block_size` values: the block absmax minus the mean, quantised."""
    scale_factor: Tensor
    """fp32, one per group of `scale_block_size` blocks."""
    scale_mean: Tensor
    """fp32 scalar: the mean of all block absmaxes, subtracted before the int8 quantisation."""
    code: Tensor
    """fp32, the 16 levels (a shared constant, not counted in `nbytes`)."""
    shape: torch.Size
    dtype: torch.dtype
    """The dtype the weight had; `dequantize()` returns it unless told otherwise."""
    block_size: int = 64
    scale_block_size: int = 256

    @classmethod
    @torch.no_grad()
    def quantize(
        cls,
        w: Tensor,
        block_size: int = 64,
        scale_block_size: int = 256,
        code: Sequence[float] | Tensor | None = None,
    ) -> NF4Weight:
        """Quantise `w` (any shape, floating) to NF4; `code` overrides the 16 levels (default `NF4_CODE`)."""
        if not w.is_floating_point():
            raise ValueError(f"NF4 quantises floating-point weights, got dtype {w.dtype}")
        if w.numel() == 0:
            raise ValueError(f"cannot quantise an empty weight of shape {tuple(w.shape)}")
        if block_size < 2 or block_size % 2:
            raise ValueError(f"block_size must be even and >= 2 (two codes share a byte), got {block_size}")
        if scale_block_size < 1:
            raise ValueError(f"scale_block_size must be >= 1, got {scale_block_size}")
        table = _code_tensor(code, w.device)
        n = w.numel()
        n_blocks = _ceil_div(n, block_size)
        n_groups = _ceil_div(n_blocks, scale_block_size)

        flat = w.detach().reshape(-1).to(torch.float32)
        blocks = F.pad(flat, (0, n_blocks * block_size - n)).view(n_blocks, block_size)
        absmax = blocks.abs().amax(dim=1)

        # Double quantisation of the absmaxes: centre them, then symmetric int8 per group with the factor
        # 256 / (2 * group absmax). The largest positive value maps to 128 and is clamped to 127, as in torchao.
        mean = absmax.mean()
        centred = F.pad(absmax - mean, (0, n_groups * scale_block_size - n_blocks)).view(n_groups, scale_block_size)
        group_absmax = centred.abs().amax(dim=1)
        # A group whose absmaxes all equal the mean would divide by zero (torchao yields NaN); its values are
        # all exactly 0, so any finite factor stores them exactly.
        factor = torch.where(group_absmax > 0, 256 / (2 * group_absmax), torch.ones_like(group_absmax))
        scale_q = (centred * factor[:, None]).round().clamp(-128, 127).reshape(-1)[:n_blocks].to(torch.int8)  # (unpadded)

        # Level indices come from the exact absmax (not the double-quantised one), as in QLoRA and torchao.
        # An all-zero block is divided by 1 instead of 0, so its values take the zero level.
        divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        normalised = (blocks / divisor[:, None]).reshape(-1)
        indices = torch.empty(normalised.numel(), dtype=torch.uint8, device=w.device)
        for start in range(0, normalised.numel(), _SEARCH_CHUNK):
            chunk = normalised[start : start + _SEARCH_CHUNK]
            # min(...).indices rather than bucketize on midpoints: the same ties and rounding as torchao
            indices[start : start + _SEARCH_CHUNK] = (chunk[:, None] - table).abs().min(dim=-1).indices.to(torch.uint8)
        packed = (indices[0::2] << 4) | indices[1::2]

        return cls(
            packed=packed,
            scale_q=scale_q,
            scale_factor=factor,
            scale_mean=mean,
            code=table,
            shape=torch.Size(w.shape),
            dtype=w.dtype,
            block_size=block_size,
            scale_block_size=scale_block_size,
        )

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes stored for this weight: packed codes, int8 scales, fp32 group factors and the fp32 mean.

        For numel n divisible by block_size * scale_block_size this is n/2 + n/64 + 4n/16384 + 4.
        """
        tensors = (self.packed, self.scale_q, self.scale_factor, self.scale_mean)
        return sum(t.numel() * t.element_size() for t in tensors)

    def indices(self) -> Tensor:
        """The level index (0..15) of every value, flattened, as int64."""
        pairs = torch.stack((self.packed >> 4, self.packed & 0x0F), dim=1)
        return pairs.reshape(-1)[: self.numel].long()

    def block_scales(self) -> Tensor:
        """The double-dequantised absmax of every block, fp32."""
        n_blocks = self.scale_q.numel()
        n_groups = self.scale_factor.numel()
        q = F.pad(self.scale_q, (0, n_groups * self.scale_block_size - n_blocks)).view(n_groups, -1)
        return (q / self.scale_factor[:, None]).reshape(-1)[:n_blocks] + self.scale_mean

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight in `dtype` (default: the original dtype), computed in fp32 and cast once."""
        # one lookup per byte: row b of this (256, 2) table is (code[b >> 4], code[b & 15])
        byte_table = torch.stack((self.code.repeat_interleave(16), self.code.repeat(16)), dim=1)
        values = byte_table.index_select(0, self.packed.int()).view(-1, self.block_size) * self.block_scales()[:, None]
        return values.reshape(-1)[: self.numel].view(self.shape).to(dtype or self.dtype)


class _NF4LinearFunction(torch.autograd.Function):
    """x @ W.T + b with W dequantised in forward and again in backward, so no dense copy of W lives between.

    Only the NF4 tensors are saved. The weight gets no gradient (it is frozen); x gets one (LoRA adapters sit
    on top) and so does the bias if someone unfreezes it.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, bias: Tensor | None, meta: dict[str, Any], *tensors: Tensor) -> Tensor:
        ctx.meta = meta
        ctx.has_bias = bias is not None
        ctx.save_for_backward(*tensors)
        w = NF4Weight(*tensors, **meta).dequantize(x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ NF4Weight(*ctx.saved_tensors, **ctx.meta).dequantize(grad_out.dtype)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(dim=0)
        return (grad_x, grad_bias, None) + (None,) * len(ctx.saved_tensors)


def nf4_nbytes(numel: int, block_size: int = 64, scale_block_size: int = 256) -> int:
    """`NF4Weight.nbytes` of a weight of `numel` elements, without quantising one: packed codes (half a byte a
    value, padded to whole blocks), an int8 scale per block, an fp32 factor per group of scales, the fp32 mean."""
    return sum(math.prod(shape) * dtype.itemsize
               for shape, dtype in nf4_storage(numel, block_size, scale_block_size).values())


def nf4_storage(numel: int, block_size: int = 64,
                scale_block_size: int = 256) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor `NF4Linear` stores for a weight of `numel` elements (the 16-level table
    aside): `packed`, `scale_q` and `scale_factor` are 1-D, so that FSDP2 can shard them on dim 0."""
    blocks = _ceil_div(numel, block_size)
    return {"packed": ((blocks * block_size // 2,), torch.uint8), "scale_q": ((blocks,), torch.int8),
            "scale_factor": ((_ceil_div(blocks, scale_block_size),), torch.int32), "scale_mean": ((), torch.float32)}


#: NF4 storage kept as frozen parameters (sharded by FSDP2) and as buffers (tiny; every rank holds them whole)
NF4_PARAMETERS = ("packed", "scale_q", "scale_factor")
# Buffers holding fp32 metadata that `module.to(dtype)` / `.half()` must not cast.
_FP32_BUFFERS = ("scale_mean", "code")


def _local_rows(full: Tensor, like: Tensor) -> Tensor:
    """The rows of `full` that `like` holds on this rank: all of them for a plain tensor, the FSDP2 shard of a
    DTensor. A 1-D mesh's dim-0 shard is worked out here as torch.chunk cuts it: DTensor's general helper
    (model/init.local_shard) builds an int64 index as long as the shard, 8 bytes for each byte of codes."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import Shard

    from dist_llm.model.init import local_shard

    mesh, placements = like.device_mesh, like.placements
    if mesh.ndim != 1 or placements[0] != Shard(0):
        return local_shard(full, like)
    chunk = _ceil_div(full.shape[0], mesh.size())
    start = min(mesh.get_local_rank() * chunk, full.shape[0])
    return full.narrow(0, start, like.to_local().shape[0])


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4 and dequantised to the input's dtype per call.

    The codes (`packed`), the int8 block scales (`scale_q`) and the fp32 group factors (`scale_factor`) are
    frozen 1-D parameters (requires_grad=False, so no optimiser or gradient sees them): FSDP2 (ZeRO-3)
    shards parameters, not buffers, so as parameters each rank keeps 1/dp of them and a block's unit gathers
    them with its other weights for forward and backward (FSDP2 gathers a unit of mixed dtypes as bytes). The
    group factors are stored as their int32 bit patterns: FSDP2's mixed precision and `module.to(bf16)` cast
    floating parameters, and a bf16 factor would change the dequantised weight. The mean (a scalar) and the
    16-level table stay fp32 buffers, held whole. The bias, if any, is a parameter with requires_grad=False.

    Built from a weight on the meta device, the layer is an empty shell of the right shapes (for a model built
    on the meta device and sharded before anything is allocated); `load_quantised` fills it, or this rank's
    shards of it.
    """

    fp32_buffers = _FP32_BUFFERS  # (model/buffers.py: no cast of the module rounds them)

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None = None,
        block_size: int = 64,
        scale_block_size: int = 256,
        code: Sequence[float] | Tensor | None = None,
    ) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(
                f"NF4Linear needs a 2-D (out_features, in_features) weight, got shape {tuple(weight.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not match weight of shape {tuple(weight.shape)}")
        self.weight_dtype = weight.dtype
        self.block_size = block_size
        self.scale_block_size = scale_block_size
        # (the bias first: the state dict keeps its order bias, packed, scale_q, scale_factor, scale_mean, code)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        if weight.is_meta:
            stored = {name: torch.empty(shape, dtype=dtype, device="meta")
                      for name, (shape, dtype) in nf4_storage(weight.numel(), block_size, scale_block_size).items()}
            stored["code"] = torch.empty(16, dtype=torch.float32, device="meta")
        else:
            q = NF4Weight.quantize(weight, block_size, scale_block_size, code)
            stored = {"packed": q.packed, "scale_q": q.scale_q, "scale_factor": q.scale_factor.view(torch.int32),
                      "scale_mean": q.scale_mean, "code": q.code}
        for name in NF4_PARAMETERS:
            setattr(self, name, nn.Parameter(stored[name], requires_grad=False))
        for name in _FP32_BUFFERS:
            self.register_buffer(name, stored[name])

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """After `to_empty` of a layer built on the meta device: the default table, and a NaN mean until
        `load_quantised` stores a weight (an unfilled layer then shows in the loss, not as a plausible weight)."""
        self.code.copy_(torch.tensor(NF4_CODE, dtype=torch.float32))
        self.scale_mean.fill_(float("nan"))

    @torch.no_grad()
    def load_quantised(self, q: NF4Weight) -> None:
        """Store `q` (this layer's whole weight, quantised) in place: where a parameter is an FSDP2 shard
        (a DTensor), only this rank's part of it."""
        meta = self._meta()
        if (q.shape, q.block_size, q.scale_block_size) != (meta["shape"], self.block_size, self.scale_block_size):
            raise ValueError(f"an NF4 weight of shape {tuple(q.shape)} (blocks {q.block_size}/{q.scale_block_size}) "
                             f"does not fit {self.extra_repr()}")
        whole = {"packed": q.packed, "scale_q": q.scale_q, "scale_factor": q.scale_factor.view(torch.int32),
                 "scale_mean": q.scale_mean, "code": q.code}
        for name, t in whole.items():
            mine = getattr(self, name)
            local = mine.to_local() if hasattr(mine, "to_local") else mine
            local.copy_(_local_rows(t, mine))

    @torch.no_grad()
    def take(self, q: NF4Weight) -> None:
        """Make `q` (this layer's whole weight, quantised) this layer's NF4 tensors without a copy: its codes, block
        scales and group factors become the (whole, unsharded) parameters, its mean the buffer's value."""
        meta = self._meta()
        if (q.shape, q.block_size, q.scale_block_size) != (meta["shape"], self.block_size, self.scale_block_size):
            raise ValueError(f"an NF4 weight of shape {tuple(q.shape)} (blocks {q.block_size}/{q.scale_block_size}) "
                             f"does not fit {self.extra_repr()}")
        stored = {"packed": q.packed, "scale_q": q.scale_q, "scale_factor": q.scale_factor.view(torch.int32)}
        for name, t in stored.items():
            setattr(self, name, nn.Parameter(t, requires_grad=False))
        self.scale_mean.copy_(q.scale_mean)
        self.code.copy_(q.code)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        block_size: int = 64,
        scale_block_size: int = 256,
        code: Sequence[float] | Tensor | None = None,
    ) -> NF4Linear:
        """Quantise an `nn.Linear`'s weight; the bias is kept as is, frozen."""
        return cls(linear.weight, linear.bias, block_size, scale_block_size, code)

    def _meta(self) -> dict[str, Any]:
        return {"shape": torch.Size((self.out_features, self.in_features)), "dtype": self.weight_dtype,
                "block_size": self.block_size, "scale_block_size": self.scale_block_size}

    def _nf4_tensors(self) -> tuple[Tensor, ...]:
        # in NF4Weight's field order. Inside an FSDP2 unit's forward and backward the parameters are the
        # gathered whole tensors; a sharded one (a DTensor, outside them) is gathered here: collective.
        packed, scale_q, factor = (t.full_tensor() if hasattr(t, "full_tensor") else t
                                   for t in (self.packed, self.scale_q, self.scale_factor))
        return (packed, scale_q, factor.view(torch.float32), self.scale_mean, self.code)

    def nf4_weight(self) -> NF4Weight:
        """The stored weight as an `NF4Weight` over this module's tensors (no copy, unless sharded: then gathered,
        a collective over the data-parallel group)."""
        return NF4Weight(*self._nf4_tensors(), **self._meta())

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """The dense weight (default: in the dtype it was quantised from)."""
        return self.nf4_weight().dequantize(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return _NF4LinearFunction.apply(x, self.bias, self._meta(), *self._nf4_tensors())

    def _apply(self, fn: Any, recurse: bool = True) -> NF4Linear:
        # Module.to(dtype), .half() and .bfloat16() cast every floating buffer; the fp32 metadata must stay
        # fp32 or the dequantised weight changes (model/buffers.py)
        apply_keeping_fp32(self, fn, lambda: super(NF4Linear, self)._apply(fn, recurse))
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight_dtype={self.weight_dtype}, block_size={self.block_size}, "
                f"scale_block_size={self.scale_block_size}")
