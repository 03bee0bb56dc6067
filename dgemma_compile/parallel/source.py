"""Where `shard` reads a rank's slices from: the loaded model's own tensors, or the safetensors files themselves.

Every slice a rank keeps is one contiguous range along one dimension of a checkpoint tensor (its heads, its 1/N of an
intermediate or vocabulary dimension), so both sources answer `take(name, full, dim, start, length)` (a linear's or
table's weight) and `take_projection(name, proj, dim, start, length)` (a routed-expert projection):
- `ModelWeights`: `full` is the loaded model's tensor; the slice is copied out of it (the model was loaded whole);
- `FileWeights`: `full` is a meta tensor of the checkpoint's shape (`loader.load(..., lazy=...)` left it unread) and
  the slice is read from its file with safetensors' `get_slice`, which copies only the requested range out of the
  memory-mapped file: the rank never holds the full tensor. `bytes_read` / `largest` count what was materialised,
  in the stored dtype, for the tests and the load report.
Quantized weights are sliced part by part (`quantized.py`: data, per-row, per-block and per-tensor scales): a torchao
tensor or a quantized `ExpertProjection` of the model, or a compressed-tensors family stored in the files, read
slice by slice and built as the loader builds the whole one (`quant.checkpoint.build_linear` / `build_experts`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from ..kernels.moe.formats import NONE
from ..model.backbone import ExpertProjection
from .errors import ParallelError
from .quantized import check_nvfp4_columns, is_quantized, narrow_projection, narrow_tensor, part_group, projection

if TYPE_CHECKING:
    from ..quant.schemes import Scheme


class ModelWeights:
    """Slices of the model's own (full, loaded) tensors, quantized ones included."""

    def take(self, name: str, full: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        """[.., length, ..] = full.narrow(dim, start, length), a fresh contiguous copy (the full tensor can be
        freed); a torchao weight is sliced part by part (`quantized.narrow_tensor`; ValueError naming `name` for a
        slice that cuts a scale group)."""
        if is_quantized(full):
            return narrow_tensor(full, dim, start, length, name)
        return full.detach().narrow(dim, start, length).clone(memory_format=torch.contiguous_format)

    def take_projection(self, name: str, proj: ExpertProjection, dim: int, start: int, length: int
                        ) -> ExpertProjection:
        """Experts (dim 0), rows (1) or columns (2) [start, start + length) of a routed-expert projection, in its
        format (`quantized.narrow_projection`)."""
        return narrow_projection(proj, dim, start, length, name)


class FileWeights:
    """Slices read straight from the checkpoint's safetensors files (module docstring).

    Args:
        sources: state-dict name -> (file, tensor key) of every float tensor left unread (`model.checkpoint.lazy.float_sources`).
        dtype, device: what a float slice is converted to (the model's weight dtype, the rank's device); quantized
            parts keep their stored dtypes.
        quantized: state-dict name -> `quant.checkpoint.StoredWeight` of every quantized weight left unread, with
            `files` (checkpoint key -> file) and `scheme` (the `quant.schemes.Scheme` they run as)
            (`model.checkpoint.lazy.quantized`).
    """

    def __init__(self, sources: dict[str, tuple[Path, str]], dtype: torch.dtype, device: torch.device,
                 quantized: dict | None = None, files: dict[str, Path] | None = None, scheme: "Scheme | None" = None):
        self.sources, self.dtype, self.device = sources, dtype, device
        self.quantized, self.files, self.scheme = quantized or {}, files or {}, scheme
        self.bytes_read = 0
        self.largest: dict[str, int] = {}  # elements of the largest slice read: by our name (float), by each
        # stored part's checkpoint key (quantized: codes and scales)
        self._files: dict[Path, object] = {}
        self._like = None

    def take(self, name: str, full: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows [start, start + length) along `dim` of the stored tensor `name` (whose shape is `full`'s); a
        quantized one as the torchao tensor the loader builds, from its stored parts' slices.
        Raises KeyError naming `name` when it is not a tensor this source reads; ValueError naming it for a slice
        that cuts a scale group."""
        if name in self.quantized:
            from ..quant.checkpoint import build_linear, template

            stored = self.quantized[name]
            parts = {key: self._read_part(key, full.shape[dim], dim, start, length, name)
                     for key in stored.all_keys()}
            if "weight_packed" in stored.keys:
                check_nvfp4_columns(dim, length, name)
            if self._like is None:
                self._like = template(self.scheme, self.device, self.dtype)
            return build_linear(stored, parts, self._like, self.dtype, self.device)
        if name not in self.sources:
            raise KeyError(f"tensor parallel: {name} was loaded whole, it has no file slice to read")
        path, key = self.sources[name]
        part = self._read(path, key, dim, start, length, name)
        if tuple(part.shape) != tuple(full.shape[:dim]) + (length,) + tuple(full.shape[dim + 1:]):
            raise ParallelError(f"tensor parallel: {path}: {key} slice along dim {dim} has shape {list(part.shape)}")
        return part.to(device=self.device, dtype=self.dtype).contiguous()

    def take_projection(self, name: str, proj: ExpertProjection, dim: int, start: int, length: int
                        ) -> ExpertProjection:
        """Experts (dim 0), rows (1) or columns (2) [start, start + length) of a routed-expert projection the loader
        left unread (`proj`: a meta one of the checkpoint's dequantized shape), read from the files: float, or
        the stored per-expert or fused compressed-tensors family sliced part by part and built as the loader
        builds the whole one. A row range must lie inside one of gate_up's halves (as `shard` asks)."""
        shape = proj.shape[:dim] + (length,) + proj.shape[dim + 1:]
        if name not in self.quantized:
            return projection(NONE, self.take(name, proj.weight, dim, start, length), [], shape)
        from ..quant.checkpoint import build_experts

        stored = self.quantized[name]
        E, N, K = proj.shape
        rows = stored.rows
        group = start // rows if dim == 1 else None  # gate_up's half holding the rows
        if group is not None and start + length > (group + 1) * rows:
            raise ValueError(f"tensor parallel: {name} rows [{start}, {start + length}) span gate and up")
        keys: dict[str, list[str]] = {}
        parts: dict[str, torch.Tensor] = {}
        for role, role_keys in stored.keys.items():
            scalar = role.endswith("global_scale")
            if stored.fused:  # [E, N, ...] parts; global scales [E, groups]
                (key,) = role_keys
                if scalar and dim == 1:
                    part = self._read_range(key, 1, group, 1)
                elif scalar and dim == 2:
                    part = self._read_range(key, 0, 0, None)
                else:
                    part = self._read_part(key, proj.shape[dim], dim, start, length, name)
                keys[role], parts[key] = [key], part
                continue
            # per expert: E * groups 2-D parts, expert-major ([rows, ...], global scales [1])
            per = len(role_keys) // E
            chosen = [(e, p) for e in range(E) for p in range(per)
                      if (dim != 0 or start <= e < start + length) and (dim != 1 or p == group)]
            keys[role] = []
            for e, p in chosen:
                key = role_keys[e * per + p]
                keys[role].append(key)
                if dim == 0 or scalar:
                    parts[key] = self._read_range(key, 0, 0, None)
                elif dim == 1:
                    parts[key] = self._read_part(key, rows, 0, start - group * rows, length, name)
                else:
                    parts[key] = self._read_part(key, K, 1, start, length, name)
        sliced = dataclasses.replace(stored, keys=keys, groups=1 if dim == 1 else stored.groups,
                                     rows=length if dim == 1 else rows)
        weight, scale, global_scale = build_experts(sliced, parts, self.device)
        try:
            return projection(self.scheme.experts, weight, [scale] + ([] if global_scale is None else [global_scale]), shape)
        except ValueError as e:  # the slice is no layout of its format (an NVFP4 input dim of 16 cut)
            raise ValueError(f"tensor parallel: {name}: {e}") from None

    # ----- reading ----------------------------------------------------------------------------------------------
    def _read_part(self, key: str, extent: int, dim: int, start: int, length: int, name: str) -> torch.Tensor:
        """A stored part's share of the weight's range [start, start + length) of `extent` along `dim`
        (`quantized.part_group`: the whole part when it is shared by the dimension)."""
        shape = self._handle(self.files[key]).get_slice(key).get_shape()
        size = shape[dim] if dim < len(shape) else 1
        group = part_group(size, extent, start, length, f"{name} ({key})")
        if group is None:
            return self._read_range(key, 0, 0, None)
        return self._read_range(key, dim, start // group, length // group)

    def _read_range(self, key: str, dim: int, start: int, length: int | None) -> torch.Tensor:
        """Stored `key`'s range [start, start + length) along `dim` (the whole tensor when `length` is None), as
        stored."""
        return self._read(self.files[key], key, dim, start, length, key)

    def _read(self, path: Path, key: str, dim: int, start: int, length: int | None, name: str) -> torch.Tensor:
        fh = self._handle(path)
        if length is None:
            part = fh.get_tensor(key)
        else:
            part = fh.get_slice(key)[tuple([slice(None)] * dim + [slice(start, start + length)])]
        self.bytes_read += part.numel() * part.element_size()
        self.largest[name] = max(self.largest.get(name, 0), part.numel())
        return part

    def _handle(self, path: Path):
        fh = self._files.get(path)
        if fh is None:
            fh = self._files[path] = safe_open(path, framework="pt", device="cpu")
        return fh

    def close(self) -> None:
        self._files.clear()
