"""`quantize(model, scheme)`: the model's projections as torchao tensors, in place, with a report of what was
quantized and what was left out and why (nothing is skipped quietly).

Covered: every `nn.Linear` of attention (q, k, v, o), of the dense MLP (gate, up, down) and of the self-conditioning
MLP, whose dims the scheme takes. Left out, each with its reason in the report: the routers, the norms and scalars,
the tied embedding (its lookup, the logits and the self-conditioning product) and the routed experts (not yet: see
`EXCLUDED_PARTS`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import ConfigError
from .schemes import check_scheme, direct_weight, torchao_config, unsupported_dims

log = logging.getLogger("dgemma_compile")

EXCLUDED_PARTS = (
    ("embed_tokens", "tied embedding (lookup, logits, self-conditioning product): not quantized yet; it is used "
                     "outside any nn.Linear"),
    ("layers.*.experts", "routed experts (3-D [E, N, K] weights): not quantized yet; dgemma::moe_experts takes "
                         "(data, scale) per projection but no moe_impl implements a quantized format"),
    ("layers.*.router", "routers: routing decisions stay in the model dtype"),
    ("*norm*, *scalar*", "RMSNorm weights and layer scalars: vectors, kept in the model dtype"),
)
"""Parts of the model no scheme covers, with the reason (also listed by `QuantReport.text`)."""


def _is_router(name: str) -> bool:
    return ".router." in f".{name}."


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
        lines = [f"quant {self.scheme}: {len(self.quantized)} linear layers quantized; weights "
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


def quantize(model: nn.Module, scheme: str) -> QuantReport:
    """Quantize `model`'s covered projections to `scheme` (`schemes.SCHEMES`) in place; returns the report.

    Raises:
        ConfigError: an unknown scheme, `nvfp4` (W4A4) on a device without sm100 tensor cores, a model already
            quantized, or torchao missing (the `[quant]` extra). Raised before any weight changes.
    """
    device = next(model.parameters()).device
    check_scheme(scheme, device)
    if getattr(model, "quant_scheme", None) is not None:
        raise ConfigError(f"quant scheme: the model is already quantized ({model.quant_scheme}); load it again")
    try:
        with _quiet_torchao():
            import torchao  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"quant scheme {scheme!r} needs torchao: pip install 'dgemma-compile[quant]' ({e})") from None
    report = QuantReport(scheme=scheme, bytes_before=weight_bytes(model))
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if _is_router(name):
            continue  # listed once in EXCLUDED_PARTS
        why = unsupported_dims(scheme, module.weight)
        if why is not None:
            report.excluded.append((name, why))
        else:
            chosen.append(name)
    report.excluded += list(EXCLUDED_PARTS)
    with _quiet_torchao():
        config = torchao_config(scheme, device)
        if config is not None:
            from torchao.quantization import quantize_

            wanted = set(chosen)
            quantize_(model, config, filter_fn=lambda m, fqn: fqn in wanted)
        else:
            build = direct_weight(scheme)
            modules = dict(model.named_modules())
            for name in chosen:
                lin = modules[name]
                lin.weight = nn.Parameter(build(lin.weight.detach()), requires_grad=False)
    report.quantized = chosen
    report.bytes_after = weight_bytes(model)
    model.quant_scheme = scheme
    log.debug("%s", report.text())
    return report


class _quiet_torchao:
    """torchao logs and warns at import and on first use (deprecations, missing optional kernels): kept out of the
    CLI's output, as the issue asks; they stay available at DEBUG level."""

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
