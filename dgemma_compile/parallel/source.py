"""Where `shard` reads a rank's slices from: the loaded model's own tensors, or the safetensors files themselves.

Every slice a rank keeps is one contiguous range along one dimension of a checkpoint tensor (its heads, its 1/N of an
intermediate or vocabulary dimension), so both sources answer `take(name, full, dim, start, length)`:
- `ModelWeights`: `full` is the loaded model's tensor; the slice is copied out of it (the model was loaded whole);
- `FileWeights`: `full` is a meta tensor of the checkpoint's shape (`loader.load(..., skip=...)` left it unread) and
  the slice is read from its file with safetensors' `get_slice`, which copies only the requested range out of the
  memory-mapped file: the rank never holds the full tensor. `bytes_read` / `largest` count what was materialised,
  in the stored dtype, for the tests and the load report.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


class ModelWeights:
    """Slices of the model's own (full, loaded) tensors."""

    def take(self, name: str, full: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        """[.., length, ..] = full.narrow(dim, start, length), a fresh contiguous copy (the full tensor can be
        freed)."""
        return full.detach().narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


class FileWeights:
    """Slices read straight from the checkpoint's safetensors files (module docstring).

    Args:
        sources: state-dict name -> (file, tensor key) of every tensor left unread (`model.weight_sources`).
        dtype, device: what a slice is converted to (the model's weight dtype, the rank's device).
    """

    def __init__(self, sources: dict[str, tuple[Path, str]], dtype: torch.dtype, device: torch.device):
        self.sources, self.dtype, self.device = sources, dtype, device
        self.bytes_read = 0
        self.largest: dict[str, int] = {}  # name -> elements of the largest slice read of it
        self._files: dict[Path, object] = {}

    def take(self, name: str, full: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows [start, start + length) along `dim` of the stored tensor `name` (whose shape is `full`'s).
        Raises KeyError naming `name` when it is not a tensor this source reads."""
        if name not in self.sources:
            raise KeyError(f"tensor parallel: {name} was loaded whole, it has no file slice to read")
        path, key = self.sources[name]
        fh = self._files.get(path)
        if fh is None:
            fh = self._files[path] = safe_open(path, framework="pt", device="cpu")
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        part = fh.get_slice(key)[index]
        if tuple(part.shape) != tuple(full.shape[:dim]) + (length,) + tuple(full.shape[dim + 1:]):
            raise RuntimeError(f"tensor parallel: {path}: {key} slice {index} has shape {list(part.shape)}")
        self.bytes_read += part.numel() * part.element_size()
        self.largest[name] = max(self.largest.get(name, 0), part.numel())
        return part.to(device=self.device, dtype=self.dtype).contiguous()

    def close(self) -> None:
        self._files.clear()
