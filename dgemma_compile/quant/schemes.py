"""The quantization schemes: each turns one `nn.Linear`'s weight into a torchao tensor subclass (torchao imported
lazily: it is the optional `[quant]` extra).

| scheme           | weights                              | activations                          | torchao                          |
|------------------|--------------------------------------|--------------------------------------|----------------------------------|
| `fp8`            | float8_e4m3fn, one scale per row     | float8_e4m3fn, dynamic, per row      | `Float8Tensor.from_hp`: Float8DynamicActivationFloat8WeightConfig's settings plus the weight amax floor |
| `fp8-weight-only`| float8_e4m3fn, one scale per row     | the model dtype                      | `Float8Tensor.from_hp`: Float8WeightOnlyConfig's settings plus the weight amax floor |
| `nvfp4-w4a16`    | NVFP4 (fp4 e2m1, fp8 scale per 16, per-tensor scale) | the model dtype      | NVFP4WeightOnlyConfig             |
| `nvfp4`          | NVFP4                                | NVFP4 (W4A4: sm100 tensor cores)     | refused on every device we have   |

Dynamic activation scales take max(|row|, `AMAX_FLOOR`): torchao's default divides by the row's amax, so an
all-zero row (the self-conditioning input of a block's first step, frozen rows of a bucket) became NaN (measured on
this CPU with torchao 0.18); with the floor a zero row stays exactly zero. Weight scales take the same floor: torchao's
fp8 configs pass none, and a weight row of zeros (an expert or output channel that is all zero) became a row of NaN
(measured); so both fp8 schemes build their `Float8Tensor`s with `Float8Tensor.from_hp` directly, with the configs'
settings (per-row granularity, `KernelPreference.AUTO` on CUDA, `TORCH` elsewhere) plus `hp_value_lb`.
"""

from __future__ import annotations

import torch

from ..config import ConfigError
from ..ops.moe import AMAX_FLOOR, NVFP4_BLOCK, amax_floor

SCHEMES = ("fp8", "fp8-weight-only", "nvfp4-w4a16", "nvfp4")
NUMERICS = "v3"
"""What the schemes cover and how, versioned like `sampler.SCHEME` (a change can change tokens): v1 (2026-11-30) the
linears; v2 (2026-12-01) + the routed experts, the lm_head and the tied embeddings' two products, and the weight amax
floor; v3 (2026-12-07) a pinned canvas position's self-conditioning input is its token's exact table row, not the
quantized product of its one-hot (`DiffusionGemma.self_conditioning_embedding`; unpinned requests: v2's tokens).
Named in `QuantReport.text()`."""


def check_scheme(scheme: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raises ConfigError naming `scheme` for an unknown name, for `nvfp4` (W4A4) on a device without sm100 tensor
    cores (every device we run on: H200 is sm90; `nvfp4-w4a16` is what an H200 runs), or for an NVFP4 scheme on a
    float16 model (torchao's NVFP4 quantization takes bfloat16 or float32 weights)."""
    if scheme not in SCHEMES:
        raise ConfigError(f"quant scheme: must be one of {SCHEMES}, got {scheme!r}")
    if scheme.startswith("nvfp4") and dtype == torch.float16:
        raise ConfigError(f"quant scheme {scheme!r}: torchao's NVFP4 takes bfloat16 or float32 weights; this model is "
                          "float16 (load it with --dtype bfloat16)")
    if scheme == "nvfp4":
        major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
        if major is None or major < 10:
            where = f"{device.type}" + (f" (sm{major}x)" if major is not None else "")
            raise ConfigError(f"quant scheme 'nvfp4' (NVFP4 weights and activations, W4A4) needs sm100 tensor cores; "
                              f"this model is on {where}. Use 'nvfp4-w4a16' (NVFP4 weights, 16-bit activations)")


def unsupported_weight(scheme: str, weight: torch.Tensor) -> str | None:
    """Why `scheme` cannot take this [N, K] linear weight (None: it can). Both FP8 layouts tile by 16 on GPUs
    (`torch._scaled_mm`), NVFP4 blocks the input dim by 16; torchao's NVFP4 weight-only config derives its per-tensor
    scale from the weight's amax with no floor, so an all-zero weight would become NaN (measured)."""
    out_dim, in_dim = weight.shape
    if in_dim % NVFP4_BLOCK or out_dim % NVFP4_BLOCK:
        return f"dims [{out_dim}, {in_dim}] are not multiples of {NVFP4_BLOCK}"
    if scheme.startswith("nvfp4") and not bool(weight.any()):
        return "an all-zero weight (NVFP4's per-tensor scale would be 0)"
    return None


def unsupported_expert_dims(scheme: str, shape: tuple[int, int, int]) -> str | None:
    """Why `scheme` cannot take an expert projection of dequantized shape (E, N, K) (None: it can): NVFP4 blocks the
    input dim by 16; the fp8 formats take any dims (`dgemma::moe_experts` reads them without `torch._scaled_mm`)."""
    if scheme.startswith("nvfp4") and shape[2] % NVFP4_BLOCK:
        return f"input dim {shape[2]} is not a multiple of {NVFP4_BLOCK}"
    return None


def _fp8_direct(device: torch.device | None = None, activations: bool = True):
    """weight -> `Float8Tensor` for the fp8 schemes: per-row weights with the amax floor and, with `activations`,
    dynamic per-row activations with the same floor (`amax_floor` of the weight's dtype, the activations' too); `KernelPreference.AUTO` on CUDA (torchao picks its kernel),
    `TORCH` elsewhere (plain torch ops: `torch._scaled_mm` where it runs, dequantize + matmul otherwise)."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import (Float8Tensor,
                                                                                QuantizeTensorToFloat8Kwargs)

    kernel = KernelPreference.AUTO if device is not None and device.type == "cuda" else KernelPreference.TORCH
    mm = Float8MMConfig(use_fast_accum=False)

    def build(w: torch.Tensor):
        floor = amax_floor(w.dtype)
        act = QuantizeTensorToFloat8Kwargs(granularity=PerRow(), mm_config=mm, hp_value_lb=floor,
                                           kernel_preference=kernel) if activations else None
        return Float8Tensor.from_hp(w, granularity=PerRow(), mm_config=mm if activations else None,
                                    hp_value_lb=floor, act_quant_kwargs=act, kernel_preference=kernel)

    return build


def torchao_config(scheme: str):
    """The torchao config applying `scheme` through `quantize_`, or None where `direct_weight` builds the weights
    (both fp8 schemes: see the module docstring)."""
    if scheme in ("fp8", "fp8-weight-only"):
        return None
    if scheme == "nvfp4-w4a16":
        from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig

        return NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True)
    raise ConfigError(f"quant scheme: {scheme!r} has no torchao config here")


def direct_weight(scheme: str, device: torch.device | None = None):
    """For the fp8 schemes: a function weight -> Float8Tensor (`_fp8_direct`)."""
    if scheme not in ("fp8", "fp8-weight-only"):
        raise ConfigError(f"quant scheme: {scheme!r} is applied through torchao's config only")
    return _fp8_direct(device, activations=scheme == "fp8")


def expert_weights(scheme: str, weight: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, ...]:
    """The routed experts' [E, N, K] weight in the plain layout `dgemma::moe_experts` reads for `scheme`
    (`model.ExpertProjection`), built with torchao's quantization primitives:

    - fp8, fp8-weight-only: (float8_e4m3fn [E, N, K], float32 scales [E, N, 1]): `Float8Tensor.from_hp` with per-row
      granularity and the amax floor, as the linears (the activation side is the op's: `quant` "fp8" quantizes its inputs per row);
    - nvfp4-w4a16: (uint8 [E, N, K/2], float8_e4m3fn block scales [E, N, K/16], float32 global scales [E, N, 1]):
      torchao's `nvfp4_quantize` with one per-tensor scale per expert and per part (`parts` equal row ranges:
      gate_up's gate and up rows are scaled apart, as llmcompressor writes them); global = 1 / torchao's per-tensor
      scale, the compressed-tensors convention (dequantized = e2m1 * block / global).
    """
    if scheme in ("fp8", "fp8-weight-only"):
        from torchao.quantization import PerRow
        from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

        q = Float8Tensor.from_hp(weight, granularity=PerRow(), hp_value_lb=amax_floor(weight.dtype))
        return q.qdata, q.scale.to(torch.float32)
    if scheme == "nvfp4-w4a16":
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

        E, N, K = weight.shape
        packed, blocks, globals_ = [], [], []
        for rows in weight.float().chunk(parts, dim=1):
            amax = rows.abs().amax(dim=(1, 2), keepdim=True).clamp(min=AMAX_FLOOR)  # an all-zero expert
            per_tensor = per_tensor_amax_to_scale(amax)  # [E, 1, 1]
            scale, data = nvfp4_quantize(rows.contiguous(), NVFP4_BLOCK, per_tensor)
            packed.append(data.view(torch.uint8).reshape(E, rows.shape[1], K // 2))
            blocks.append(scale.reshape(E, rows.shape[1], K // NVFP4_BLOCK))
            globals_.append((1.0 / per_tensor).expand(E, rows.shape[1], 1))
        return torch.cat(packed, 1), torch.cat(blocks, 1), torch.cat(globals_, 1).contiguous()
    raise ConfigError(f"quant scheme: {scheme!r} has no expert format")
