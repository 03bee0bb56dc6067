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

Each scheme is one `Scheme` object (`SCHEME_OBJECTS`), looked up once from its name where a name comes in (`scheme`:
the CLI's `--quant`, `quantize(model, name)`, a checkpoint's quantization config); past that point code asks the
object (its routed experts' `ExpertFormat`, its torchao config or weight builder, what dims it takes), never
compares names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.moe.formats import (AMAX_FLOOR, FP8, FP8_WEIGHT_ONLY, NVFP4_BLOCK, NVFP4_W4A16, ExpertFormat,
                                   Registered, amax_floor)
from ..model.config import ConfigError

NUMERICS = "v3"
"""What the schemes cover and how, versioned like `sampler.SCHEME` (a change can change tokens): v1 (2026-11-30) the
linears; v2 (2026-12-01) + the routed experts, the lm_head and the tied embeddings' two products, and the weight amax
floor; v3 (2026-12-07) a pinned canvas position's self-conditioning input is its token's exact table row, not the
quantized product of its one-hot (`DiffusionGemma.self_conditioning_embedding`; unpinned requests: v2's tokens).
Named in `QuantReport.text()`."""


@dataclass(frozen=True)
class Scheme(Registered):
    """A quantization scheme: its `name` (the CLI's `--quant`, what reports print) and the `experts` format its
    routed experts are stored in (`kernels.moe.formats`). Subclasses say how a linear's weight is built."""

    name: str
    experts: ExpertFormat

    dynamic_activations = False
    """Activations quantized per row at run time (fp8 W8A8): under tensor parallel a row-parallel projection then
    scales each rank's slice of a row by that slice's own amax (`kernels.sample.vocab_parallel.VocabShard.scheme`)."""

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raises ConfigError naming the scheme where it cannot run on `device` for a `dtype` model."""

    def unsupported_weight(self, weight: torch.Tensor) -> str | None:
        """Why this scheme cannot take this [N, K] linear weight (None: it can). Both FP8 layouts tile by 16 on
        GPUs (`torch._scaled_mm`), NVFP4 blocks the input dim by 16."""
        out_dim, in_dim = weight.shape
        if in_dim % NVFP4_BLOCK or out_dim % NVFP4_BLOCK:
            return f"dims [{out_dim}, {in_dim}] are not multiples of {NVFP4_BLOCK}"
        return None

    def unsupported_expert_dims(self, shape: tuple[int, int, int]) -> str | None:
        """Why this scheme cannot take an expert projection of dequantized shape (E, N, K) (None: it can): the
        experts' format has no layout for it (`ExpertFormat.layout`: NVFP4 blocks the input dim by 16; the fp8
        formats take any dims, `dgemma::moe_experts` reads them without `torch._scaled_mm`)."""
        try:
            self.experts.layout(shape)
        except ValueError:
            return f"input dim {shape[2]} is not a multiple of {NVFP4_BLOCK}"
        return None

    def torchao_config(self):
        """The torchao config applying the scheme through `quantize_`, or None where `direct_weight` builds the
        weights."""
        return None

    def direct_weight(self, device: torch.device | None = None):
        """A function weight -> torchao tensor, for a scheme without a torchao config. Raises ConfigError otherwise."""
        raise ConfigError("quant scheme", f"{self.name!r} is applied through torchao's config only")

    def expert_weights(self, weight: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, ...]:
        """The routed experts' [E, N, K] weight in the plain layout of `experts` (`ExpertFormat.layout`), built
        with torchao's quantization primitives. `parts`: equal row ranges scaled apart (gate_up's gate and up)."""
        raise ConfigError("quant scheme", f"{self.name!r} has no expert format")



@dataclass(frozen=True)
class Fp8Scheme(Scheme):
    """float8_e4m3fn weights with one scale per row; with `activations`, dynamic per-row fp8 activations (W8A8)."""

    activations: bool = True

    @property
    def dynamic_activations(self) -> bool:
        return self.activations

    def direct_weight(self, device=None):
        """weight -> `Float8Tensor` (`_fp8_direct`: the configs' settings plus the amax floor)."""
        return _fp8_direct(device, activations=self.activations)

    def expert_weights(self, weight, parts=1):
        """(float8_e4m3fn [E, N, K], float32 scales [E, N, 1]): `Float8Tensor.from_hp` with per-row granularity and
        the amax floor, as the linears (the activation side is the op's: `ExpertFormat.activation`)."""
        from torchao.quantization import PerRow
        from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

        q = Float8Tensor.from_hp(weight, granularity=PerRow(), hp_value_lb=amax_floor(weight.dtype))
        return q.qdata, q.scale.to(torch.float32)


@dataclass(frozen=True)
class Nvfp4Scheme(Scheme):
    """NVFP4 weights (fp4 e2m1, an fp8 scale per 16 inputs, a per-tensor scale); `w4a4`: NVFP4 activations too,
    which need sm100 tensor cores (refused everywhere we run: an H200 is sm90)."""

    w4a4: bool = False

    def check(self, device, dtype):
        """torchao's NVFP4 quantization takes bfloat16 or float32 weights; W4A4 needs sm100."""
        if dtype == torch.float16:
            raise ConfigError(f"quant scheme {self.name!r}", "torchao's NVFP4 takes bfloat16 or float32 weights; this "
                              "model is float16 (load it with --dtype bfloat16)")
        if self.w4a4:
            major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
            if major is None or major < 10:
                where = f"{device.type}" + (f" (sm{major}x)" if major is not None else "")
                raise ConfigError(f"quant scheme {self.name!r} (NVFP4 weights and activations, W4A4) needs sm100 "
                                  f"tensor cores; this model is on {where}. Use 'nvfp4-w4a16' (NVFP4 weights, 16-bit "
                                  "activations)")

    def _refuse_w4a4(self) -> None:
        """W4A4 (NVFP4 activations) has no builder here: even where `check` passes (sm100), its weights are not
        quantized as W4A16 under its name."""
        if self.w4a4:
            raise ConfigError("quant scheme", f"{self.name!r} (NVFP4 weights and activations, W4A4) has no torchao "
                              "config or expert format here; use 'nvfp4-w4a16'")

    def unsupported_weight(self, weight):
        """As `Scheme`'s, and an all-zero weight: torchao's NVFP4 weight-only config derives its per-tensor scale
        from the weight's amax with no floor, so it would become NaN (measured)."""
        why = super().unsupported_weight(weight)
        if why is None and not bool(weight.any()):
            return "an all-zero weight (NVFP4's per-tensor scale would be 0)"
        return why

    def torchao_config(self):
        self._refuse_w4a4()
        from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig

        return NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True)

    def expert_weights(self, weight, parts=1):
        """(uint8 [E, N, K/2], float8_e4m3fn block scales [E, N, K/16], float32 global scales [E, N, 1]): torchao's
        `nvfp4_quantize` with one per-tensor scale per expert and per part (gate_up's gate and up rows are scaled
        apart, as llmcompressor writes them); global = 1 / torchao's per-tensor scale, the compressed-tensors
        convention (dequantized = e2m1 * block / global)."""
        self._refuse_w4a4()
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


SCHEME_OBJECTS: dict[str, Scheme] = {s.name: s for s in (
    Fp8Scheme("fp8", FP8, activations=True),
    Fp8Scheme("fp8-weight-only", FP8_WEIGHT_ONLY, activations=False),
    Nvfp4Scheme("nvfp4-w4a16", NVFP4_W4A16),
    Nvfp4Scheme("nvfp4", NVFP4_W4A16, w4a4=True),  # its experts as W4A16: the op has no fp4 activations
)}
SCHEMES = tuple(SCHEME_OBJECTS)
"""The schemes' names, as `--quant` takes them (`cli.args.QUANT_SCHEMES` repeats them without importing torch)."""


def scheme(name: "str | Scheme") -> Scheme:
    """The scheme named `name` (a `Scheme` passes through). Raises ConfigError naming it otherwise."""
    if isinstance(name, Scheme):
        return name
    try:
        return SCHEME_OBJECTS[name]
    except (KeyError, TypeError):
        raise ConfigError("quant scheme", f"must be one of {SCHEMES}, got {name!r}") from None


Scheme.lookup = staticmethod(scheme)


def check_scheme(name: str, device: torch.device, dtype: torch.dtype) -> Scheme:
    """The scheme named `name`, checked for `device` and a `dtype` model. Raises ConfigError naming it for an unknown
    name, for `nvfp4` (W4A4) on a device without sm100 tensor cores (every device we run on: H200 is sm90;
    `nvfp4-w4a16` is what an H200 runs), or for an NVFP4 scheme on a float16 model (torchao's NVFP4 quantization
    takes bfloat16 or float32 weights)."""
    s = scheme(name)
    s.check(device, dtype)
    return s


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
