"""`quantize(model, scheme)`: the model's projections as torchao tensors, in place, with a report of what was
quantized and what was left out and why (nothing is skipped quietly).

Covered: every `nn.Linear` of attention (q, k, v, o), of the dense MLP (gate, up, down) and of the self-conditioning
MLP whose dims the scheme takes (torchao tensors); the routed experts (each `model.ExpertProjection` in the plain
(weight, scales) layout `dgemma::moe_experts` reads, built with torchao's quantization primitives); the lm_head, and
the tied embeddings' two products: the logits (`model.lm_head`, a quantized copy of the table) and the
self-conditioning product probs @ table (`model.sc_embedding`, the transposed table as a [V -> D] projection).
Left out, each with its reason in the report: the embedding lookup, the routers, the norms and scalars
(`EXCLUDED_PARTS`), and any weight whose dims the scheme cannot take.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..model.backbone import ExpertProjection
from ..model.config import ConfigError
from .schemes import NUMERICS, Scheme, check_scheme

log = logging.getLogger("dgemma_compile")

EXCLUDED_PARTS = (
    ("embed_tokens (lookup)", "the lookup gathers one row per token: kept in the model dtype"),
    ("layers.*.router", "routers: routing decisions stay in the model dtype"),
    ("*norm*, *scalar*", "RMSNorm weights and layer scalars: vectors, kept in the model dtype"),
)
"""Parts of the model no scheme covers, with the reason (also listed by `QuantReport.text`)."""

VISION_EXCLUDED = ("vision (tower and embedder)", "runs once per image at prefill, outside the denoise loop: kept in "
                   "the model dtype (issue 27, item 7: not yet measured quantized)")
"""A multimodal model's vision encoder: listed in the report when the model has one."""


def _is_router(name: str) -> bool:
    return ".router." in f".{name}."


def _parts(name: str) -> int:
    """How many separately scaled halves a projection's rows hold: gate_up's gate and up rows get their own NVFP4
    global scales (as llmcompressor writes them), down one."""
    return 2 if name.endswith("gate_up_proj") else 1


def _tied_copies(model: nn.Module, scheme: Scheme, report: "QuantReport") -> None:
    """The embeddings' two products as `nn.Linear`s for the scheme to quantize: `lm_head` (the logits; only for tied
    models: an untied lm_head is an `nn.Linear` already) and `sc_embedding` (the self-conditioning product
    probs [.., V] @ table [V, D], i.e. a projection with weight table.T [D, V]). A copy whose dims the scheme cannot
    take is not made (listed in the report instead)."""
    table = model.embed_tokens.weight.detach()
    copies = []
    if model.lm_head is None:
        copies.append(("lm_head", "lm_head (the tied embeddings' logits)", table.clone()))
    copies.append(("sc_embedding", "sc_embedding (the self-conditioning product probs @ embeddings)",
                   table.T.contiguous()))
    for attr, what, weight in copies:
        why = scheme.unsupported_weight(weight)
        if why is not None:
            report.excluded.append((what, why))
            continue
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        setattr(model, attr, linear)


@dataclass
class QuantReport:
    """What `quantize` did. quantized: module names; excluded: (module name or pattern, reason); weight bytes of the
    whole model before and after."""

    scheme: str
    quantized: list[str] = field(default_factory=list)
    excluded: list[tuple[str, str]] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def text(self) -> str:
        lines = [f"quant {self.scheme} (numerics {NUMERICS}): {len(self.quantized)} projections quantized; weights "
                 f"{self.bytes_before / 2**20:.2f} MiB -> {self.bytes_after / 2**20:.2f} MiB"]
        lines += [f"  excluded {name}: {reason}" for name, reason in self.excluded]
        return "\n".join(lines)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, counting a torchao tensor by its inner tensors."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        total += sum(x.numel() * x.element_size() for x in _leaves(t))
    return total


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data (itself, or a tensor subclass's flattened inner tensors)."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _leaves(getattr(t, n))]
    return [t]


def quantize(model: nn.Module, scheme: "str | Scheme") -> QuantReport:
    """Quantize `model`'s covered projections to `scheme` (a name of `schemes.SCHEMES`, or its `Scheme`) in place;
    returns the report.

    Raises:
        ConfigError: an unknown scheme, `nvfp4` (W4A4) on a device without sm100 tensor cores, an NVFP4 scheme on a
            float16 model, a model already quantized or sharded for tensor parallel (`parallel.shard`), or torchao
            missing (the `[quant]` extra). Raised before any weight changes.
    """
    device = next(model.parameters()).device
    scheme = check_scheme(scheme, device, next(model.parameters()).dtype)
    if model.checkpoint.quant_scheme is not None:
        raise ConfigError("quant scheme", f"the model is already quantized ({model.checkpoint.quant_scheme}); quantize a model "
                          "loaded from a float checkpoint")
    if model.tensor_parallel is not None:
        raise ConfigError("quant scheme", "the model is sharded for tensor parallel (parallel.shard); quantize it "
                          "before sharding (a rank's slice of a row-parallel weight would get scales of its own)")
    try:
        with quiet_torchao():
            import torchao  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"quant scheme {scheme.name!r} needs torchao: pip install 'dgemma-compile[quant]' ({e})") from None
    report = QuantReport(scheme=scheme.name, bytes_before=weight_bytes(model))
    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertProjection)]
    expert_why = {name: scheme.unsupported_expert_dims(m.shape) for name, m in experts}
    _tied_copies(model, scheme, report)
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if _is_router(name) or name.startswith("vision."):
            continue  # listed once in EXCLUDED_PARTS / VISION_EXCLUDED
        why = scheme.unsupported_weight(module.weight)
        if why is not None:
            report.excluded.append((name, why))
        else:
            chosen.append(name)
    if model.vision is not None:
        report.excluded.append(VISION_EXCLUDED)
    report.excluded += list(EXCLUDED_PARTS)
    with quiet_torchao():
        config = scheme.torchao_config()
        if config is not None:
            from torchao.quantization import quantize_

            wanted = set(chosen)
            quantize_(model, config, filter_fn=lambda m, fqn: fqn in wanted)
        else:
            build = scheme.direct_weight(device)
            modules = dict(model.named_modules())
            for name in chosen:
                lin = modules[name]
                lin.weight = nn.Parameter(build(lin.weight.detach()), requires_grad=False)
        for name, proj in experts:
            if expert_why[name] is not None:
                report.excluded.append((name, expert_why[name]))
                continue
            proj.set_quantized(scheme.experts, *scheme.expert_weights(proj.weight.detach(), parts=_parts(name)))
            chosen.append(name)
    report.quantized = chosen
    report.bytes_after = weight_bytes(model)
    model.checkpoint.quant_scheme = scheme.name
    log.debug("%s", report.text())
    return report


class quiet_torchao:
    """torchao logs and warns at import and on first use (deprecations, missing optional kernels): kept out of the
    CLI's output, as the issue asks. Inside the block its loggers (`_NOISY_LOGGERS`) are raised to ERROR and every
    warning is ignored -- dropped, not kept; torchao's own calls are all the block holds."""

    def __enter__(self):
        import warnings

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._levels = {name: logging.getLogger(name).level for name in _NOISY_LOGGERS}
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        self._warnings.__exit__(*exc)
        return False


_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
"""Loggers torchao's import and first use write to: its optional CUDA extensions that do not load on a CPU build
("Failed to load ..._C_mxfp8..."), and torch's note on its enum registration."""
