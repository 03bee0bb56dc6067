"""Weight quantization through torchao (the optional `[quant]` extra, imported lazily).

- `schemes.py`: the schemes (`SCHEMES`: fp8, fp8-weight-only, nvfp4-w4a16; nvfp4 = W4A4, refused on devices without
  sm100 tensor cores) and how each builds a quantized weight.
- `quantize.py`: `quantize(model, scheme) -> QuantReport`: which projections are quantized, what is left out and why.
"""

from .quantize import EXCLUDED_PARTS, QuantReport, quantize
from .schemes import SCHEMES

__all__ = ["EXCLUDED_PARTS", "QuantReport", "SCHEMES", "quantize"]
