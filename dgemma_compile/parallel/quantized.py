"""A quantized weight's per-rank slice: one rule for every quantized layout we hold or read.

A quantized weight of dequantized shape S is several tensors, its *parts*: the data (fp8 codes [.., N, K], or two
e2m1 codes a byte [.., N, K/2]) and its scales (one per row [.., N, 1], one per block of 16 inputs [.., N, K/16], one
per tensor [1] or scalar, one per expert and row [E, N, 1]). Along a dimension d of S each part either
- spans it (size S[d]): sliced like the weight, [start, start + length);
- spans it in groups of g (size S[d] / g: the packed codes g = 2, the NVFP4 block scales g = 16): sliced
  [start / g, (start + length) / g), which needs g to divide start and length -- a slice that would cut a group is
  refused naming the tensor (an NVFP4 input dim of 704 / 8 = 88 columns a rank is not a multiple of 16);
- or is shared by the whole dimension (size 1, or no such dimension): kept whole.
So the slice's parts are the parts' slices, and it dequantizes to exactly the slice of the dequantized weight:
every value keeps its own codes and its own scales (a row-parallel slice of a per-row fp8 weight keeps the full
row's scale). Zero rows padded onto a slice (the vocabulary's padding, `vocab.py`) are zero in every part, so they
dequantize to 0.

Applied here to the weights a loaded model holds: torchao's `Float8Tensor` and `NVFP4Tensor` (linears; NVFP4's block
scales unswizzled first and swizzled again, so any multiple of 16 can be cut, not only at torchao's tiles of 128
rows x 64 columns) and `model.ExpertProjection`'s plain parts; `source.FileWeights` applies the same rule to a
compressed-tensors checkpoint's stored parts (`part_group`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.moe.formats import NVFP4_BLOCK, ExpertFormat
from ..model.backbone import ExpertProjection


def part_group(size: int, extent: int, start: int, length: int, name: str) -> int | None:
    """How many of the weight's `extent` values along the sliced dimension one value of a part of `size` covers:
    1 (the part spans the dimension), g (it groups it by g) or None (size 1: shared by the whole dimension, kept
    whole).

    Raises:
        ValueError: the range [start, start + length) cuts a group (the message names `name`).
    """
    if size == extent:
        return 1
    if size == 1:
        return None
    group = extent // size
    if extent % size or start % group or length % group:
        raise ValueError(f"tensor parallel: {name} holds one value per {group} of the {extent} along this dimension; "
                         f"the rank's range [{start}, {start + length}) cuts a group of {group}")
    return group


def narrow_part(part: torch.Tensor, extent: int, dim: int, start: int, length: int, name: str,
                padded: int | None = None) -> torch.Tensor:
    """`part`'s share of the weight's range [start, start + length) along `dim` (`part_group`), a fresh contiguous
    tensor; `padded`: the slice's length after zero padding (>= length), the part padded with zeros in proportion.
    Raises ValueError as `part_group` (a padding that cuts a group too)."""
    size = part.shape[dim] if dim < part.ndim else 1
    group = part_group(size, extent, start, length, name)
    if group is None:
        return part.clone()
    out = part.narrow(dim, start // group, length // group).clone(memory_format=torch.contiguous_format)
    if padded is not None and padded > length:
        part_group(size, extent, 0, padded, name)
        shape = list(out.shape)
        shape[dim] = (padded - length) // group
        out = torch.cat([out, out.new_zeros(shape)], dim=dim)
    return out


def is_quantized(weight: torch.Tensor) -> bool:
    """A torchao tensor subclass (not a plain tensor or parameter)."""
    return type(weight) not in (torch.Tensor, nn.Parameter) and hasattr(weight, "__tensor_flatten__")


def check_sliceable(weight: torch.Tensor, name: str) -> None:
    """ValueError naming `name` unless `weight` is a torchao layout `narrow_tensor` slices: a per-row `Float8Tensor`
    or a per-tensor-scaled `NVFP4Tensor` (what `quant.quantize` and the compressed-tensors loader build)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    if isinstance(weight, Float8Tensor) and weight.ndim == 2 and tuple(weight.scale.shape) == (weight.shape[0], 1):
        return
    if isinstance(weight, NVFP4Tensor) and weight.ndim == 2 and weight.per_tensor_scale is not None \
            and weight.per_tensor_scale.ndim == 0:
        return
    raise ValueError(f"tensor parallel: {name} is a {type(weight).__name__} of a layout that cannot be sliced here "
                     f"(per-row Float8Tensor and per-tensor-scaled NVFP4Tensor can)")


def check_nvfp4_columns(dim: int, length: int, name: str) -> None:
    """ValueError naming `name` when an NVFP4 weight's slice along its input dim (`dim` 1) keeps a number of columns
    that is not whole blocks. `part_group` alone cannot see it where K is one block (16): the single block scale
    per row then looks shared by the whole dimension."""
    if dim == 1 and length % NVFP4_BLOCK:
        raise ValueError(f"tensor parallel: {name} (NVFP4) keeps {length} input columns, not a multiple of its "
                         f"block of {NVFP4_BLOCK}")


def narrow_tensor(weight: torch.Tensor, dim: int, start: int, length: int, name: str,
                  padded: int | None = None) -> torch.Tensor:
    """Rows (dim 0) or input columns (dim 1) [start, start + length) of a 2-D torchao weight [N, K] (`Float8Tensor`
    per row, `NVFP4Tensor`), as the same kind of tensor with the same settings; `padded` as `narrow_part`.

    Raises:
        ValueError: a slice that cuts a scale group, or a torchao tensor of another kind (the message names `name`).
    """
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    check_sliceable(weight, name)
    extent = weight.shape[dim]
    if isinstance(weight, Float8Tensor):
        qdata, scale = (narrow_part(p, extent, dim, start, length, f"{name} ({what})", padded)
                        for p, what in ((weight.qdata, "fp8 data"), (weight.scale, "per-row scale")))
        block = [min(b, s) for b, s in zip(weight.block_size, qdata.shape)]
        block[1] = qdata.shape[1]  # one scale per row, over the columns the rank holds
        return Float8Tensor(qdata, scale, block_size=block, mm_config=weight.mm_config,
                            act_quant_kwargs=weight.act_quant_kwargs, kernel_preference=weight.kernel_preference,
                            dtype=weight.dtype)
    # an NVFP4Tensor (check_sliceable admits the two)
    from torchao.prototype.mx_formats.utils import from_blocked, hp_data_dims_to_swizzled_scale_dims_nvfp4, to_blocked

    N, K = weight.shape
    scale = from_blocked(weight.scale.flatten(), N, K // weight.block_size) if weight.is_swizzled_scales \
        else weight.scale
    qdata = narrow_part(weight.qdata, extent, dim, start, length, f"{name} (e2m1 codes)", padded)
    scale = narrow_part(scale, extent, dim, start, length, f"{name} (NVFP4 block scales)", padded)
    check_nvfp4_columns(dim, length, name)
    if weight.is_swizzled_scales:
        scale = to_blocked(scale).view(hp_data_dims_to_swizzled_scale_dims_nvfp4(qdata.shape[0],
                                                                                 qdata.shape[1] * 2))
    return NVFP4Tensor(qdata, scale, weight.block_size, weight.orig_dtype,
                       per_tensor_scale=weight.per_tensor_scale.clone(),
                       act_per_tensor_scale=weight.act_per_tensor_scale, is_swizzled_scales=weight.is_swizzled_scales,
                       use_triton_kernel=weight.use_triton_kernel, act_quant_kwargs=weight.act_quant_kwargs)


def projection(format: ExpertFormat, weight: torch.Tensor, scales: list[torch.Tensor],
               shape: tuple[int, int, int]) -> ExpertProjection:
    """An `ExpertProjection` of dequantized shape `shape` (E, N, K) holding `weight` and `scales` in the layout of
    `format` (checked by `set_quantized`; unquantized: a plain weight)."""
    proj = ExpertProjection(0, shape[1], shape[2])  # no [E, N, K] allocation: the weight is replaced at once
    if not format.quantized:
        proj.weight = nn.Parameter(weight, requires_grad=False)
    else:
        proj.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        proj.set_quantized(format, weight, *scales)
    return proj


def narrow_projection(proj: ExpertProjection, dim: int, start: int, length: int, name: str) -> ExpertProjection:
    """Experts (dim 0), output rows (1) or input columns (2) [start, start + length) of a routed-expert projection,
    every part by `part_group`'s rule: a new `ExpertProjection` in the same format."""
    shape = proj.shape
    parts = [narrow_part(p.detach(), shape[dim], dim, start, length, f"{name} ({what})")
             for p, what in zip([proj.weight] + proj.scales(), ("data", "scale", "global scale"))]
    try:
        return projection(proj.format, parts[0], parts[1:], shape[:dim] + (length,) + shape[dim + 1:])
    except ValueError as e:  # the slice is no layout of its format (an NVFP4 input dim of 16 cut)
        raise ValueError(f"tensor parallel: {name}: {e}") from None


def cat_projections(parts: list[ExpertProjection], dim: int) -> ExpertProjection:
    """Projections of one format side by side along dim 0 (experts) or 1 (output rows; every part of the layouts
    is per row there): one `ExpertProjection`."""
    tensors = [torch.cat(ts, dim=dim) for ts in zip(*([p.weight.detach()] + p.scales() for p in parts))]
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return projection(parts[0].format, tensors[0], tensors[1:], tuple(shape))
