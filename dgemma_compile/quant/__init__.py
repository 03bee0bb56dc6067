"""Weight quantization through torchao (the optional `[quant]` extra, imported lazily).

- `schemes.py`: the schemes (`SCHEMES`: fp8, fp8-weight-only, nvfp4-w4a16; nvfp4 = W4A4, refused on devices without
  sm100 tensor cores) and how each builds a quantized weight.
- `quantize.py`: `quantize(model, scheme) -> QuantReport`: which projections are quantized, what is left out and why.
- `checkpoint.py`: compressed-tensors checkpoints (`quantization_config`, FP8 and NVFP4 tensor families) read by
  `dg.load` into the same torchao tensors, from the stored data as they are.
"""

from .quantize import EXCLUDED_PARTS, QuantReport, quantize
from .schemes import SCHEMES

__all__ = ["EXCLUDED_PARTS", "QuantReport", "SCHEMES", "quantize"]
