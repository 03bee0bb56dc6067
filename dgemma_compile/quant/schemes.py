"""The quantization schemes: each turns one `nn.Linear`'s weight into a torchao tensor subclass (torchao imported
lazily: it is the optional `[quant]` extra).

| scheme           | weights                              | activations                          | torchao                          |
|------------------|--------------------------------------|--------------------------------------|----------------------------------|
| `fp8`            | float8_e4m3fn, one scale per row     | float8_e4m3fn, dynamic, per row      | Float8DynamicActivationFloat8WeightConfig (CUDA sm89+); elsewhere `Float8Tensor.from_hp` with the same settings (KernelPreference.TORCH) |
| `fp8-weight-only`| float8_e4m3fn, one scale per row     | the model dtype                      | Float8WeightOnlyConfig            |
| `nvfp4-w4a16`    | NVFP4 (fp4 e2m1, fp8 scale per 16, per-tensor scale) | the model dtype      | NVFP4WeightOnlyConfig             |
| `nvfp4`          | NVFP4                                | NVFP4 (W4A4: sm100 tensor cores)     | refused on every device we have   |

Dynamic activation scales take max(|row|, `ACTIVATION_AMAX_FLOOR`): torchao's default divides by the row's amax, so an
all-zero row (the self-conditioning input of a block's first step, frozen rows of a bucket) became NaN (measured on
this CPU with torchao 0.18); with the floor a zero row stays exactly zero.
"""

from __future__ import annotations

import torch

from ..config import ConfigError

SCHEMES = ("fp8", "fp8-weight-only", "nvfp4-w4a16", "nvfp4")
ACTIVATION_AMAX_FLOOR = 1e-12
"""Lower bound of a dynamic activation row's amax (the `fp8` scheme): keeps all-zero rows finite."""
NVFP4_BLOCK = 16
"""NVFP4 scales one fp8 factor per 16 consecutive input elements: the input dim must be a multiple of it."""


def check_scheme(scheme: str, device: torch.device) -> None:
    """Raises ConfigError naming `scheme` for an unknown name, or for `nvfp4` (W4A4) on a device without sm100 tensor
    cores (every device we run on: H200 is sm90); `nvfp4-w4a16` is what an H200 runs."""
    if scheme not in SCHEMES:
        raise ConfigError(f"quant scheme: must be one of {SCHEMES}, got {scheme!r}")
    if scheme == "nvfp4":
        major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
        if major is None or major < 10:
            where = f"{device.type}" + (f" (sm{major}x)" if major is not None else "")
            raise ConfigError(f"quant scheme 'nvfp4' (NVFP4 weights and activations, W4A4) needs sm100 tensor cores; "
                              f"this model is on {where}. Use 'nvfp4-w4a16' (NVFP4 weights, 16-bit activations)")


def unsupported_dims(scheme: str, weight: torch.Tensor) -> str | None:
    """Why `scheme` cannot take a weight of this shape (None: it can). Both FP8 layouts tile by 16 on GPUs
    (`torch._scaled_mm`), NVFP4 blocks the input dim by 16."""
    out_dim, in_dim = weight.shape
    if in_dim % NVFP4_BLOCK or out_dim % NVFP4_BLOCK:
        return f"dims [{out_dim}, {in_dim}] are not multiples of {NVFP4_BLOCK}"
    return None


def _fp8_direct() -> "object":
    """A torchao config-like callable building the `fp8` scheme's weight where torchao's config refuses (CPU, CUDA
    below sm89): `Float8Tensor.from_hp` with per-row weights, dynamic per-row activations, the amax floor, and
    KernelPreference.TORCH (plain torch ops: `torch._scaled_mm` where it runs, dequantize + matmul otherwise)."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import (Float8Tensor,
                                                                                QuantizeTensorToFloat8Kwargs)

    mm = Float8MMConfig(use_fast_accum=False)
    act = QuantizeTensorToFloat8Kwargs(granularity=PerRow(), mm_config=mm, hp_value_lb=ACTIVATION_AMAX_FLOOR,
                                       kernel_preference=KernelPreference.TORCH)
    return lambda w: Float8Tensor.from_hp(w, granularity=PerRow(), mm_config=mm, act_quant_kwargs=act,
                                          kernel_preference=KernelPreference.TORCH)


def torchao_config(scheme: str, device: torch.device):
    """The torchao config applying `scheme` through `quantize_` (`set_inductor_config=False`: every Inductor setting
    is `CompileOptions`'), or None for `fp8` where torchao's config refuses the device (then `direct_weight` builds
    the weights with the same settings)."""
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, PerRow)

    if scheme == "fp8-weight-only":
        return Float8WeightOnlyConfig(set_inductor_config=False)
    if scheme == "nvfp4-w4a16":
        from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig

        return NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True)
    if scheme == "fp8":
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
            return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False,
                                                             activation_value_lb=ACTIVATION_AMAX_FLOOR)
        return None
    raise ConfigError(f"quant scheme: {scheme!r} has no torchao config here")


def direct_weight(scheme: str):
    """For `fp8` where torchao's config refuses the device: a function weight -> Float8Tensor (`_fp8_direct`)."""
    if scheme != "fp8":
        raise ConfigError(f"quant scheme: {scheme!r} is applied through torchao's config only")
    return _fp8_direct()
