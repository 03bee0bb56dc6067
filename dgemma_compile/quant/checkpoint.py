"""compressed-tensors checkpoints (llmcompressor's output): `quantization_config` -> the scheme it runs as, and the
stored tensor families -> the torchao tensors `quantize` builds for that scheme, from the stored data as they are
(never dequantized and quantized again). The loader (`loader.py`) checks every header through `locate` before
any tensor is read, then calls `build_linear` / `build_experts`.

| `format` (config_groups) | weights                            | input_activations           | runs as           |
|--------------------------|------------------------------------|-----------------------------|-------------------|
| `float-quantized`        | fp8 e4m3, `channel`                | fp8, dynamic, `token`       | `fp8`             |
| `float-quantized`        | fp8 e4m3, `channel`                | none                        | `fp8-weight-only` |
| `nvfp4-pack-quantized`   | fp4 e2m1, `tensor_group`, 16       | none                        | `nvfp4-w4a16`     |
| `nvfp4-pack-quantized`   | fp4 e2m1, `tensor_group`, 16       | fp4, dynamic `local` (W4A4) | `nvfp4-w4a16` (*) |

(*) with a logged note: W4A4 needs sm100 tensor cores; the stored activation scales are not used. Anything else
(int4/AWQ/GPTQ formats, static activation scales, another strategy or group size, sparsity, transforms, a quantized
KV cache) is a `FormatError` naming config.json and the field.

Stored families of one projection `m` with a dequantized weight [N, K] (compressed-tensors' names and formulas):
- FP8: `m.weight` float8_e4m3fn [N, K], `m.weight_scale` float [N, 1]; weight = `weight.float() * weight_scale`.
- NVFP4: `m.weight_packed` uint8 [N, K/2] (two e2m1 codes a byte, the even column in the low nibble),
  `m.weight_scale` float8_e4m3fn [N, K/16], `m.weight_global_scale` float32 [1] (W4A4 also `m.input_global_scale`
  [1]); weight = `e2m1 * weight_scale / weight_global_scale`.

Routed experts are stored per expert (`experts.{e}.{gate,up,down}_proj.<family>`, llmcompressor's output) or fused
(`experts.{gate_up,down}_proj{,_packed}` [E, N, ...], `_scale` stacked likewise, `_global_scale` [E, 2] for (gate,
up) and [E, 1] for down); both become one `ExpertProjection` each (gate rows first).

torchao's NVFP4 tensor multiplies its scales by `per_tensor_scale` = 1 / weight_global_scale (float32): its
dequantized weight is `e2m1 * (weight_scale * (1 / weight_global_scale))`, within 3 float32 roundings (relative
3 * 2**-24) of the compressed-tensors formula and exactly equal to this reordering of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..kernels.moe.formats import NVFP4_BLOCK as BLOCK
from ..model.backbone import ExpertProjection
from .quantize import QuantReport, quiet_torchao, weight_bytes
from .schemes import Scheme, scheme as scheme_named

FLOAT = ("F32", "BF16", "F16")
ROLES = ("weight", "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
"""The tensors of one stored projection `m`, each named `m.<role>`."""


@dataclass(frozen=True)
class Family:
    """A compressed-tensors tensor family: the roles a stored projection must have (`need`; the quantized data
    first) and may have (`optional`), and each role's safetensors dtypes and shape (`spec`)."""

    name: str
    """As messages print it: "FP8", "NVFP4"."""
    need: tuple[str, ...]
    optional: tuple[str, ...] = ()

    @property
    def data_role(self) -> str:
        """The role holding the quantized data."""
        return self.need[0]

    def spec(self, lead: tuple[int, ...], N: int, K: int, groups: int = 1) -> dict[str, tuple[tuple[str, ...], tuple]]:
        """role -> (safetensors dtypes, shape) for a dequantized [*lead, N, K] weight; the global scales of fused
        experts are [E, groups]."""
        raise NotImplementedError

    def check_dims(self, K: int) -> str | None:
        """Why this family cannot store an input dim `K` (None: it can)."""
        return None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Fp8Family(Family):
    """`m.weight` float8_e4m3fn [N, K], `m.weight_scale` float [N, 1]."""

    def spec(self, lead, N, K, groups=1):
        return {"weight": (("F8_E4M3",), (*lead, N, K)), "weight_scale": (FLOAT, (*lead, N, 1))}


@dataclass(frozen=True)
class Nvfp4Family(Family):
    """`m.weight_packed` uint8 [N, K/2], `m.weight_scale` float8_e4m3fn [N, K/16], `m.weight_global_scale` float [1]
    (fused experts: [E, groups]); `m.input_global_scale` likewise, for W4A4."""

    def spec(self, lead, N, K, groups=1):
        scalar = (lead[0], groups) if lead else (1,)
        return {"weight_packed": (("U8",), (*lead, N, K // 2)), "weight_scale": (("F8_E4M3",), (*lead, N, K // BLOCK)),
                "weight_global_scale": (FLOAT, scalar), "input_global_scale": (FLOAT, scalar)}

    def check_dims(self, K):
        return f"input dim {K} is not a multiple of {BLOCK} (NVFP4 block)" if K % BLOCK else None


FP8 = Fp8Family("FP8", need=("weight", "weight_scale"))
NVFP4 = Nvfp4Family("NVFP4", need=("weight_packed", "weight_scale", "weight_global_scale"),
                    optional=("input_global_scale",))


class FormatError(ValueError):
    """A quantized checkpoint this loader cannot read as it is; the message names the file and the tensor or field
    (the loader raises it as `CheckpointError`)."""


@dataclass(frozen=True)
class StoredFormat:
    """What config.json's `quantization_config` says. scheme: the `quant.schemes.Scheme` it runs as; family: the
    tensor family it stores (`FP8`, `NVFP4`); w4a4: NVFP4 activations were asked for (run as W4A16); ignore: module
    names the tool left unquantized."""

    scheme: Scheme
    family: Family
    w4a4: bool = False
    ignore: tuple[str, ...] = ()


@dataclass
class StoredWeight:
    """One weight stored quantized. name: our parameter (`...q_proj.weight`, `layers.{i}.experts.gate_up_proj.weight`);
    module: the checkpoint's name of it (for messages); keys: role ("weight", "weight_scale", "weight_global_scale",
    "input_global_scale") -> checkpoint keys, stacked in order (one for a linear or fused experts; E * groups for
    per-expert tensors, expert-major); experts: an `ExpertProjection`; fused: 3-D tensors with [E, groups] global
    scales; groups: 2 for gate_up (gate, up), else 1; rows: output rows per group."""

    name: str
    module: str
    keys: dict[str, list[str]] = field(default_factory=dict)
    experts: bool = False
    fused: bool = False
    groups: int = 1
    rows: int = 0

    def all_keys(self) -> list[str]:
        return [k for ks in self.keys.values() for k in ks]


# ----- quantization_config -------------------------------------------------------------------------------------------
_ARG_DEFAULTS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": None,
                 "block_structure": None, "dynamic": False, "actorder": None}
"""compressed-tensors' QuantizationArgs defaults, for a config that leaves a field out."""


def read_format(config: dict, source: str) -> StoredFormat | None:
    """The stored format of a checkpoint's config.json dict (None: no `quantization_config`, a float checkpoint).

    Raises:
        FormatError: naming `source` and the field, for a method, format or scheme this loader does not read.
    """
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(qc, dict):
        raise FormatError(f"{where}: must be an object")
    if qc.get("quant_method") != "compressed-tensors":
        raise FormatError(f"{where}.quant_method is {qc.get('quant_method')!r}; only 'compressed-tensors' checkpoints "
                          f"(FP8 dynamic, FP8 weight-only, NVFP4) load")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise FormatError(f"{where}.quantization_status is {qc.get('quantization_status')!r}; only 'compressed' "
                          f"checkpoints (quantized data as stored) load")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(key):
            raise FormatError(f"{where}.{key} is set; not supported (dense weights, no transforms, float KV cache)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise FormatError(f"{where}.config_groups: must be a non-empty object")
    found = {}
    for gname, group in groups.items():
        if not isinstance(group, dict):
            raise FormatError(f"{where}.config_groups.{gname}: must be an object")
        found[gname] = _group_format(group, group.get("format") or qc.get("format"),
                                     f"{where}.config_groups.{gname}")
    if len(set(found.values())) != 1:
        named = {g: f"{s}{' (W4A4)' if w4a4 else ''}" for g, (s, _, w4a4) in found.items()}
        raise FormatError(f"{where}.config_groups: mixed schemes {named}; one scheme per checkpoint is supported")
    scheme, family, w4a4 = next(iter(found.values()))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise FormatError(f"{where}.ignore: must be a list of module names")
    return StoredFormat(scheme=scheme, family=family, w4a4=w4a4, ignore=tuple(ignore))


def _group_format(group: dict, fmt: str | None, where: str) -> tuple[Scheme, Family, bool]:
    """(the scheme it runs as, its tensor family, W4A4 asked for) of one config group; `fmt` the compressed-tensors
    format name, the one place the family is looked up from a string."""
    weights, acts = group.get("weights"), group.get("input_activations")
    if group.get("output_activations"):
        raise FormatError(f"{where}.output_activations is set; output quantization is not supported")
    if not isinstance(weights, dict):
        raise FormatError(f"{where}.weights: must be an object")
    if fmt == "float-quantized":
        _require(weights, f"{where}.weights", "FP8 (float-quantized) weights", num_bits=8, type="float",
                 strategy="channel", symmetric=True, dynamic=False, group_size=None, block_structure=None)
        if acts is None:
            return scheme_named("fp8-weight-only"), FP8, False
        _require(acts, f"{where}.input_activations", "FP8 activations", num_bits=8, type="float", strategy="token",
                 symmetric=True, dynamic=True)
        return scheme_named("fp8"), FP8, False
    if fmt == "nvfp4-pack-quantized":
        _require(weights, f"{where}.weights", "NVFP4 weights", num_bits=4, type="float", strategy="tensor_group",
                 group_size=BLOCK, symmetric=True, dynamic=False)
        if weights.get("scale_dtype") not in (None, "torch.float8_e4m3fn"):
            raise FormatError(f"{where}.weights.scale_dtype is {weights['scale_dtype']!r}; NVFP4 loads with "
                              f"'torch.float8_e4m3fn' scales only")
        if acts is None:
            return scheme_named("nvfp4-w4a16"), NVFP4, False
        _require(acts, f"{where}.input_activations", "NVFP4 activations", num_bits=4, type="float",
                 strategy="tensor_group", group_size=BLOCK, dynamic="local")
        return scheme_named("nvfp4-w4a16"), NVFP4, True
    raise FormatError(f"{where}.format is {fmt!r}; supported: 'float-quantized' (FP8) and 'nvfp4-pack-quantized'")


def _require(args: dict, where: str, what: str, **want) -> None:
    if not isinstance(args, dict):
        raise FormatError(f"{where}: must be an object")
    for key, value in want.items():
        got = args.get(key, _ARG_DEFAULTS.get(key))
        if got != value:
            raise FormatError(f"{where}.{key} is {got!r}; {what} load with {value!r} only")


# ----- headers -------------------------------------------------------------------------------------------------------
Header = dict[str, tuple[str, tuple[int, ...]]]
"""checkpoint key -> (safetensors dtype string, shape), over every file."""


def locate(name: str, shape: tuple[int, ...], candidates: list[str], fmt: StoredFormat, header: Header,
           file_of: Callable[[str], str], experts: bool = False) -> StoredWeight | None:
    """Where our parameter `name` (dequantized `shape`: [N, K], or [E, N, K] with `experts`) is stored quantized,
    with every tensor of its family checked (present, dtype, shape); None when it is stored in float (the plain
    path). `candidates`: the checkpoint keys that would hold it in float, preferred first (`loader.hf_names`).

    Raises:
        FormatError: `file_of(key): tensor key ...` for a missing scale, a wrong dtype or shape, or a family that
            is not the config's.
    """
    for cand in candidates:
        base = cand[: -len(".weight")] if cand.endswith(".weight") else cand
        stored = _experts(name, base, shape, fmt, header, file_of) if experts else _linear(name, base, shape, fmt,
                                                                                          header, file_of)
        if stored is not None or cand in header:  # quantized here, or the float weight is here
            return stored
    return None


def _linear(name, module, shape, fmt, header, file_of) -> StoredWeight | None:
    keys = _family_keys(module + ".", fmt, header, file_of)
    if keys is None:
        return None
    N, K = shape
    _check(keys, fmt, (), N, K, header, file_of, module)
    return StoredWeight(name=name, module=module, keys={r: [k] for r, k in keys.items()}, rows=N)


def _experts(name, base, shape, fmt, header, file_of) -> StoredWeight | None:
    E, N, K = shape
    prefix, proj = base.rsplit(".", 1)  # "...layers.{i}.experts", "gate_up_proj" | "down_proj"
    groups = 2 if proj == "gate_up_proj" else 1
    per_expert = ("gate_proj", "up_proj") if groups == 2 else ("down_proj",)
    fused = _fused_keys(base, fmt, header, file_of)
    if fused is not None:
        _check(fused, fmt, (E,), N, K, header, file_of, base, groups=groups)
        return StoredWeight(name=name, module=base, keys={r: [k] for r, k in fused.items()}, experts=True,
                            fused=True, groups=groups, rows=N // groups)
    first = _family_keys(f"{prefix}.0.{per_expert[0]}.", fmt, header, file_of)
    if first is None:
        return None
    keys: dict[str, list[str]] = {}
    for e in range(E):
        for p in per_expert:
            module = f"{prefix}.{e}.{p}"
            found = _family_keys(module + ".", fmt, header, file_of)
            if found is None:
                role = fmt.family.data_role
                raise FormatError(f"{file_of(first[role])}: tensor {module}.{role} is missing (expert {e} of {E}; "
                                  "the other experts are stored quantized)")
            _check(found, fmt, (), N // groups, K, header, file_of, module)
            for role, k in found.items():
                keys.setdefault(role, []).append(k)
    if "input_global_scale" in keys and len(keys["input_global_scale"]) != len(keys["weight_scale"]):
        raise FormatError(f"{file_of(keys['input_global_scale'][0])}: tensor {keys['input_global_scale'][0]}: some "
                          f"experts of {prefix} store an input_global_scale and others do not")
    return StoredWeight(name=name, module=f"{prefix}.*.{'/'.join(per_expert)}", keys=keys, experts=True,
                        groups=groups, rows=N // groups)


def _family_keys(module: str, fmt: StoredFormat, header: Header, file_of) -> dict[str, str] | None:
    """role -> key of the family stored under `module` ("...q_proj."), None when it is stored in float."""
    return _select({role: module + role for role in ROLES}, module.rstrip("."), fmt, header, file_of)


def _fused_keys(base: str, fmt: StoredFormat, header: Header, file_of) -> dict[str, str] | None:
    """role -> key of fused 3-D expert tensors (`base` = "...experts.gate_up_proj"), None when absent or float."""
    names = {"weight": base, "weight_packed": base + "_packed", "weight_scale": base + "_scale",
             "weight_global_scale": base + "_global_scale", "input_global_scale": base + "_input_global_scale"}
    return _select(names, base, fmt, header, file_of)


def _select(names: dict[str, str], module: str, fmt: StoredFormat, header: Header, file_of) -> dict[str, str] | None:
    """The family's role -> key out of `names` (role -> key where it would be), each required one present; None when
    only a float `weight` is there. Raises naming a missing tensor or one of another family."""
    present = {role: k for role, k in names.items() if k in header}
    if not present or set(present) == {"weight"} and header[present["weight"]][0] in FLOAT:
        return None
    need = fmt.family.need
    allowed = set(need) | set(fmt.family.optional)
    anchor = next(iter(present.values()))
    for role, key in present.items():
        if role not in allowed:
            raise FormatError(f"{file_of(key)}: tensor {key} is not part of the {fmt.family} family the "
                              f"quantization_config declares ({fmt.scheme})")
    for role in need:
        if role not in present:
            raise FormatError(f"{file_of(anchor)}: tensor {names[role]} is missing (the {fmt.family} family "
                              f"of {module} needs {', '.join(names[r] for r in need)})")
    if "input_global_scale" in present and not fmt.w4a4:
        raise FormatError(f"{file_of(present['input_global_scale'])}: tensor {present['input_global_scale']} is an "
                          f"activation scale, but the quantization_config has no input_activations")
    return present


def _check(keys: dict[str, str], fmt: StoredFormat, lead: tuple[int, ...], N: int, K: int, header: Header, file_of,
           module: str, groups: int = 1) -> None:
    """Each tensor's dtype and shape against the family's layout for a dequantized [*lead, N, K] weight; the global
    scales of fused experts are [E, groups]."""
    why = fmt.family.check_dims(K)
    if why is not None:
        key = keys[fmt.family.data_role]
        raise FormatError(f"{file_of(key)}: tensor {key}: {why}")
    spec = fmt.family.spec(lead, N, K, groups)
    for role, key in keys.items():
        dtypes, shape = spec[role]
        dt, got = header[key]
        if dt not in dtypes:
            raise FormatError(f"{file_of(key)}: tensor {key} has dtype {dt}, expected {' or '.join(dtypes)}")
        if tuple(got) != tuple(shape):
            raise FormatError(f"{file_of(key)}: tensor {key} has shape {list(got)}, expected {list(shape)} (the "
                              f"{fmt.family} layout of {module}, dequantized {[*lead, N, K]})")


# ----- tensors -------------------------------------------------------------------------------------------------------
def template(scheme: Scheme, device: torch.device, dtype: torch.dtype):
    """A torchao weight as `quantize` builds it for `scheme` on `device` for a `dtype` model (a 16x16 one): its
    settings (mm config, activation kwargs with the dtype's amax floor, kernel preference, scale layout) are copied
    onto the loaded tensors, so that a loaded model and a model quantized on load are the same kind of model."""
    lin = nn.Linear(BLOCK, BLOCK, bias=False, device="meta")  # no random init: the caller's RNG stays as it was
    lin.weight = nn.Parameter(torch.ones(BLOCK, BLOCK, device=device, dtype=dtype), requires_grad=False)
    with quiet_torchao():
        config = scheme.torchao_config()
        if config is None:
            return scheme.direct_weight(device)(lin.weight.detach())
        from torchao.quantization import quantize_

        quantize_(lin, config)
    return lin.weight


def build_linear(stored: StoredWeight, tensors: dict[str, torch.Tensor], like, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """The torchao tensor of a stored [N, K] linear weight (a `Float8Tensor` or `NVFP4Tensor` with `like`'s
    settings, `dtype` its dequantized dtype), from `tensors` (key -> tensor as stored, uncast)."""
    t = {role: tensors[ks[0]].to(device) for role, ks in stored.keys.items()}
    with quiet_torchao():
        if "weight_packed" not in t:
            from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

            qdata = t["weight"]
            return Float8Tensor(qdata, t["weight_scale"].float(), block_size=[1, qdata.shape[-1]],
                                mm_config=like.mm_config, act_quant_kwargs=like.act_quant_kwargs,
                                kernel_preference=like.kernel_preference, dtype=dtype)
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
        from torchao.prototype.mx_formats.utils import hp_data_dims_to_swizzled_scale_dims_nvfp4, to_blocked

        packed, scale = t["weight_packed"], t["weight_scale"]
        N, K = packed.shape[0], packed.shape[1] * 2
        if like.is_swizzled_scales:  # a permutation (padded to 128 x 4 tiles), no arithmetic
            scale = to_blocked(scale).view(hp_data_dims_to_swizzled_scale_dims_nvfp4(N, K))
        per_tensor = (1.0 / t["weight_global_scale"].float()).reshape(())
        return NVFP4Tensor(packed, scale, like.block_size, dtype, per_tensor_scale=per_tensor,
                           is_swizzled_scales=like.is_swizzled_scales, use_triton_kernel=like.use_triton_kernel,
                           act_quant_kwargs=like.act_quant_kwargs)


def build_experts(stored: StoredWeight, tensors: dict[str, torch.Tensor],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weight, weight_scale, weight_global_scale) for `ExpertProjection.set_quantized`: fp8 [E, N, K] with float32
    [E, N, 1] scales; NVFP4 uint8 [E, N, K/2], float8_e4m3fn [E, N, K/16] and float32 [E, N, 1] global scales (each
    projection's own on its rows). Per-expert tensors are stacked, gate rows before up rows."""
    def stacked(role: str) -> torch.Tensor:
        parts = [tensors[k] for k in stored.keys[role]]
        if stored.fused:
            return parts[0]
        E = len(parts) // stored.groups
        return torch.stack(parts).reshape(E, stored.groups * parts[0].shape[0], *parts[0].shape[1:])

    weight = stacked("weight" if "weight" in stored.keys else "weight_packed")
    scale = stacked("weight_scale")
    if "weight_global_scale" not in stored.keys:
        return weight.to(device), scale.float().to(device), None
    if stored.fused:
        g_EG = tensors[stored.keys["weight_global_scale"][0]]
    else:
        g_EG = torch.stack([tensors[k] for k in stored.keys["weight_global_scale"]]).reshape(weight.shape[0], -1)
    g_EN1 = g_EG.float()[:, :, None].expand(-1, -1, stored.rows).reshape(weight.shape[0], -1, 1).contiguous()
    return weight.to(device), scale.to(device), g_EN1.to(device)


# ----- the loaded model's report ------------------------------------------------------------------------------------
def quantizable(model: nn.Module) -> dict[str, str]:
    """Parameters a checkpoint may store quantized: each `nn.Linear`'s weight ("linear") and each routed-expert
    projection's ("experts"). The vision encoder (`vision.*`) is not: it loads in float (`quantize.VISION_EXCLUDED`)."""
    kinds = {}
    for name, module in model.named_modules():
        if name.startswith("vision."):
            continue
        if isinstance(module, nn.Linear):
            kinds[f"{name}.weight"] = "linear"
        elif isinstance(module, ExpertProjection):
            kinds[f"{name}.weight"] = "experts"
    return kinds


def report(model: nn.Module, fmt: StoredFormat, quantized: dict, kinds: dict[str, str], dtype: torch.dtype,
           candidates: Callable[[str], list[str]]) -> QuantReport:
    """What the checkpoint stores quantized, and what it leaves in float with the reason (its ignore list, a float
    tensor, or a part no Linear holds); bytes_before: the same model with every weight in the model dtype.
    `candidates`: our parameter name -> the checkpoint keys that may hold it (`loader.hf_names`)."""
    report = QuantReport(scheme=fmt.scheme.name, quantized=[n.removesuffix(".weight") for n in quantized])
    ignore = set(fmt.ignore)
    for name in kinds:
        if name not in quantized:
            module = name.removesuffix(".weight")
            listed = any(k.removesuffix(".weight") in ignore for k in candidates(name))
            report.excluded.append((module, "in the checkpoint's quantization_config ignore list" if listed
                                    else "stored unquantized in the checkpoint"))
    uses = "lookup, logits and self-conditioning product" if model.lm_head is None else \
        "lookup and self-conditioning product"
    report.excluded += [("embed_tokens", f"embedding ({uses}): not a Linear, stored in the model dtype"),
                        ("*norm*, *scalar*", "RMSNorm weights and layer scalars: vectors, kept in the model dtype")]
    return count_bytes(report, model, dtype)


def count_bytes(report: QuantReport, model: nn.Module, dtype: torch.dtype) -> QuantReport:
    """`report` with `model`'s weight bytes as it is now (`bytes_after`) and with each of `report.quantized` in
    `dtype` instead (`bytes_before`); after a tensor-parallel load, the rank's own bytes (`parallel.load_sharded`)."""
    report.bytes_after = weight_bytes(model)
    modules = dict(model.named_modules())
    report.bytes_before = report.bytes_after
    for name in report.quantized:  # a Linear (no bias) or an ExpertProjection: its own bytes are the stored family's
        owner = modules[name]
        shape = owner.shape if isinstance(owner, ExpertProjection) else owner.weight.shape
        report.bytes_before += math.prod(shape) * dtype.itemsize - weight_bytes(owner)
    return report
