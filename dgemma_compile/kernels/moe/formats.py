"""The routed experts' stored weight formats as objects: one `ExpertFormat` per format, looked up once by its name
(`expert_format`) where a name comes in: the `quant` argument of `dgemma::moe_experts` (an op's schema takes strings,
not objects), a quantization scheme (`quant.schemes.Scheme.experts`), a checkpoint's quantization config. Past that
point code asks the object (`quantized`, `layout`, `dequantize`, `activation`), never compares names.

| format             | weight                      | scale 1 (`weight_scale`)       | scale 2 (`weight_global_scale`) |
|--------------------|-----------------------------|--------------------------------|---------------------------------|
| `none`             | model dtype [E, N, K]       | -                              | -                               |
| `fp8`, `fp8-weight-only` | float8_e4m3fn [E, N, K] | float32 [E, N, 1] (per row)  | -                               |
| `nvfp4-w4a16`      | uint8 [E, N, K/2] (two e2m1 codes, even column in the low nibble) | float8_e4m3fn [E, N, K/16] | float32 [E, N, 1] |

Dequantized: fp8 `weight * weight_scale`; NVFP4 `e2m1(code) * weight_scale / weight_global_scale` (the
compressed-tensors formula, in this order: the product of an e2m1 value and an fp8 scale is exact in float32, so one
rounding; the global scale is stored per row so that gate and up rows may differ). Every part of every layout is per
expert (dim 0) and per output row (dim 1), so tensor parallel slices and concatenates those dims part by part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-12
"""Lower bound of every amax a scale is computed from (fp8 activation and weight rows, NVFP4 per-tensor scales;
`quant.schemes`), in float32: a zero row or an all-zero weight stays zero instead of 0/0 = NaN."""
NVFP4_BLOCK = 16
"""NVFP4 scales one fp8 factor per 16 consecutive input elements: the input dim must be a multiple of it."""

Part = tuple[str, "torch.dtype | None", tuple[int, int, int]]
"""(name, dtype or None for the model's, shape) of one stored tensor of a projection."""


def amax_floor(dtype: torch.dtype) -> float:
    """The amax floor of a tensor of `dtype` (torchao's `hp_value_lb`): torchao clamps and divides by 448 in the
    tensor's own dtype, where `AMAX_FLOOR` is 0 in float16 (measured: a zero row became NaN); so at least the dtype's
    smallest normal (float16: 2**-14, whose 1/448 is still a nonzero float16)."""
    return max(AMAX_FLOOR, torch.finfo(dtype).tiny)


def fp8_fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] through float8_e4m3fn with one dynamic scale per row, max(amax, floor) / 448 computed in x's dtype
    as torchao's per-row activation quantization does (`_choose_scale_float8`; the floor is `amax_floor(x.dtype)`),
    returned in float32: what an fp8 GEMM multiplies (codes times scale)."""
    scale = (x.abs().amax(-1, keepdim=True).clamp(min=amax_floor(x.dtype)) / FP8_MAX).to(torch.float32)
    q = (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(torch.float32) * scale


class Registered:
    """A value object registered under its `name`: str() is the name, and a copy, a deep copy (of a model) or a
    pickle (to a rank) is the registered object itself, found again by `lookup(name)` (a module-level function, so
    that pickle can name it). Subclasses are frozen dataclasses with a `name` field."""

    lookup = None

    def __str__(self) -> str:
        return self.name

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return type(self).lookup, (self.name,)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (uint8 in [0, 16): sign bit 3, exponent bits 2-1, mantissa bit 0) -> float32 values
    {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign. Elementwise arithmetic (no table), so Inductor fuses it into its reader."""
    mag = (codes & 7).to(torch.int32)
    exp, man = mag >> 1, (mag & 1).to(torch.float32)
    val = torch.where(exp == 0, man * 0.5, torch.exp2((exp - 1).to(torch.float32)) * (1.0 + man * 0.5))
    return torch.where(codes >= 8, -val, val)


@dataclass(frozen=True)
class ExpertFormat(Registered):
    """A routed-expert weight format: the unquantized one (the model dtype, no scales). Subclasses override
    `layout`, `dequantize` and, for quantized activations, `activation`."""

    name: str
    """The op's `quant` argument and `model.ExpertProjection.quant`; what reports print."""

    @property
    def quantized(self) -> bool:
        """Stored with scales (the op then computes in float32)."""
        return False

    def stored_columns(self, K: int) -> int:
        """The stored weight's last dim for a dequantized input dim `K`."""
        return K

    def dequantized_shape(self, stored: tuple[int, ...]) -> tuple[int, int, int]:
        """(E, N, K) of a projection whose stored weight has shape `stored` [E, N, columns]."""
        E, N, columns = stored
        return E, N, columns

    def layout(self, shape: tuple[int, int, int]) -> list[Part]:
        """The stored tensors of a projection of dequantized shape `shape` (E, N, K), weight first. Raises ValueError
        for a shape the format cannot hold."""
        return [("weight", None, shape)]

    def compute_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The dtype the op's products run in: the activations' unquantized; float32 for a quantized format, as
        torchao's fp8 and NVFP4 linears compute."""
        return torch.float32 if self.quantized else activations

    def dequantize(self, weight: torch.Tensor, scales: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The [..., N, K] weights in `dtype` from their stored tensors (any leading dims: all experts, one expert,
        or gathered rows)."""
        return weight

    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The input as this format's GEMM multiplies it, in `dtype`."""
        return x.to(dtype)

    def check(self, shape: tuple[int, int, int], weight: torch.Tensor, scales: list[torch.Tensor]) -> None:
        """Checks one projection's stored tensors against `layout(shape)`. Raises ValueError naming the tensor and
        what was expected."""
        want = self.layout(shape)
        got = [weight] + list(scales)
        if len(got) != len(want):
            raise ValueError(f"expert weights ({self.name}): expected {[w[0] for w in want]}, got {len(got)} tensors")
        for (name, dtype, shp), t in zip(want, got):
            if tuple(t.shape) != shp or (dtype is not None and t.dtype != dtype):
                raise ValueError(f"expert weights ({self.name}): {name} must be {dtype or 'the model dtype'} "
                                 f"{list(shp)}, got {t.dtype} {list(t.shape)}")



@dataclass(frozen=True)
class Fp8Rows(ExpertFormat):
    """float8_e4m3fn weights with one float32 scale per output row; with `fp8_activations` the op also quantizes
    its input rows to fp8 dynamically (W8A8), else it multiplies them in float32 (weight-only)."""

    fp8_activations: bool = False

    @property
    def quantized(self) -> bool:
        return True

    def layout(self, shape):
        E, N, K = shape
        return [("weight", torch.float8_e4m3fn, (E, N, K)), ("weight_scale", torch.float32, (E, N, 1))]

    def dequantize(self, weight, scales, dtype):
        return (weight.to(torch.float32) * scales[0]).to(dtype)

    def activation(self, x, dtype):
        return fp8_fake_quant_rows(x) if self.fp8_activations else x.to(dtype)


@dataclass(frozen=True)
class Nvfp4(ExpertFormat):
    """NVFP4 weights (two e2m1 codes a byte, an fp8 scale per `NVFP4_BLOCK` inputs, a float32 global scale per row)
    with 16-bit activations."""

    @property
    def quantized(self) -> bool:
        return True

    def stored_columns(self, K):
        return K // 2

    def dequantized_shape(self, stored):
        E, N, columns = stored
        return E, N, columns * 2

    def layout(self, shape):
        E, N, K = shape
        if K % NVFP4_BLOCK:
            raise ValueError(f"expert weights: {self.name} needs an input dim that is a multiple of {NVFP4_BLOCK}, "
                             f"got {K}")
        return [("weight", torch.uint8, (E, N, K // 2)),
                ("weight_scale", torch.float8_e4m3fn, (E, N, K // NVFP4_BLOCK)),
                ("weight_global_scale", torch.float32, (E, N, 1))]

    def dequantize(self, weight, scales, dtype):
        block, global_scale = scales
        codes = torch.stack([weight & 15, weight >> 4], dim=-1).flatten(-2)  # even column in the low nibble
        vals = e2m1_values(codes).unflatten(-1, (-1, NVFP4_BLOCK)) * block.to(torch.float32)[..., None]
        return (vals / global_scale[..., None]).flatten(-2).to(dtype)


NONE = ExpertFormat("none")
FP8 = Fp8Rows("fp8", fp8_activations=True)
FP8_WEIGHT_ONLY = Fp8Rows("fp8-weight-only")
NVFP4_W4A16 = Nvfp4("nvfp4-w4a16")
EXPERT_FORMATS: dict[str, ExpertFormat] = {f.name: f for f in (NONE, FP8, FP8_WEIGHT_ONLY, NVFP4_W4A16)}


def expert_format(name: str) -> ExpertFormat:
    """The format named `name` (`EXPERT_FORMATS`). Raises ValueError naming the `quant` argument otherwise."""
    try:
        return EXPERT_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"expert weights: quant must be one of {tuple(EXPERT_FORMATS)}, got {name!r}") from None


ExpertFormat.lookup = staticmethod(expert_format)
