"""Inductor lowering of `dgemma::moe_experts` for CUDA: the grouped-GEMM Triton kernels offered to the autotuner.

UNVERIFIED: written against torch 2.13's `torch/_inductor/kernel/custom_op.py` on a machine without a GPU. Nothing
here has run on CUDA; the CPU tests check only that registering is explicit and leaves CPU graphs unchanged. It is
verified when the GPU script has compiled a CUDA graph with it and compared the result to `moe_experts_loop`. The
GPU machine's torch 2.11 may have an older custom-op autotuning API (its signature changed between releases).

What `register_moe_lowering()` installs (never at import): an entry in Inductor's `user_lowerings` (consulted before
its built-in lowerings; returning None falls through to them) for `dgemma::moe_experts`. For a call whose tensors
are on CUDA and whose `impl` is one of `impls`, it hands the call to `autotune_custom_op`, whose choices are
- the Triton kernels (`moe_grouped_gemm.moe_experts_triton`), one choice per block configuration, traced by make_fx
  through `wrap_triton` into a subgraph of user Triton kernels;
- `moe_experts_grouped` traced (Inductor's own `_grouped_mm` lowering then offers its choices for each projection);
- the extern fallback: `dgemma::moe_experts_grouped_fallback` called eagerly, i.e. `torch._grouped_mm` per projection.
The autotuner benchmarks them on the call's shapes and the winner is inlined. Any other call (CPU tensors, another
impl) returns None and is lowered as before. Quantized experts never get here: the op's fake implementation refuses
a scale while the graph is traced.

Why not a `TritonTemplate`: a template renders one kernel with one output buffer, while this op is a routing prep,
two GEMM kernels with an [M, I] intermediate and a combine. The custom-op autotuning API takes whole Python
implementations, so the kernels tested under the interpreter are the ones benchmarked, unchanged.

The helper op `dgemma::moe_experts_grouped_fallback` exists because `autotune_custom_op` calls its fallback op with
the tensor inputs first (positionally) and the non-tensor arguments as keywords, which `dgemma::moe_experts`'s schema
(a scale after each weight) does not accept; its schema is tensors only.

Wiring: with `kernels.moe.op.moe_decompositions` the "grouped" call is decomposed before lowering and never reaches this
lowering; a graph must keep the call opaque (compiled without that entry) for the autotuner to see it. Inductor's FX
graph cache and AOTAutograd's cache do not key on `user_lowerings`: a graph compiled before registering is served
from the cache unchanged (observed in the CPU test), so the pipeline must tag the cache key (as `moe_cache_key` does)
or disable those caches when it registers this lowering.
"""

from __future__ import annotations

import torch

from ..kernels.moe.formats import expert_format
from ..kernels.moe.op import moe_experts_grouped

# (block_m, block_n, block_k): small-M decode-like tiles and larger prefill tiles; tl.dot needs each >= 16
BLOCK_CONFIGS = ((16, 64, 64), (32, 64, 32), (64, 64, 32), (64, 128, 32), (128, 128, 32))

_state: dict = {}  # "fallback": the helper op's overload, "previous": the user lowering replaced, if any


def _triton_choice(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI, *, block_m, block_n, block_k, **_op_args):
    from .moe_grouped_gemm import moe_experts_triton

    return moe_experts_triton(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI, block_m=block_m, block_n=block_n,
                              block_k=block_k)


def _grouped_choice(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI, **_op_args):
    return moe_experts_grouped(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI)


def _fallback_op() -> torch._ops.OpOverload:
    """`dgemma::moe_experts_grouped_fallback(x, w, idx, gate_up, down)`: `moe_experts_grouped` as an opaque op, defined
    on first use (so importing this module registers nothing)."""
    if "fallback" not in _state:
        @torch.library.custom_op("dgemma::moe_experts_grouped_fallback", mutates_args=())
        def fallback(x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_EID: torch.Tensor,
                     down_EDI: torch.Tensor) -> torch.Tensor:
            return moe_experts_grouped(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI)

        @fallback.register_fake
        def _(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
            return torch.empty_like(x_ND)

        _state["fallback"] = fallback._opoverload
    return _state["fallback"]


def _call_args(args, kwargs):
    """(tensors x, w, idx, gate_up, down; impl; expert weight format) of a `dgemma::moe_experts` call as the lowering
    receives it."""
    names = [a.name for a in torch.ops.dgemma.moe_experts.default._schema.arguments]
    bound = dict(zip(names, args)) | kwargs
    tensors = [bound[n] for n in ("x_ND", "w_NK", "idx_NK", "gate_up_EID", "down_EDI")]
    return tensors, bound["impl"], bound["quant"]


def register_moe_lowering(impls: tuple[str, ...] = ("grouped",),
                          block_configs: tuple[tuple[int, int, int], ...] = BLOCK_CONFIGS) -> None:
    """Install the autotuned lowering of `dgemma::moe_experts` for CUDA calls whose impl is in `impls` (see the module
    docstring; unverified on a GPU). Idempotent: a second call replaces the first's entry.

    Args: impls: the implementations the autotuned kernels may stand in for (same math; "grouped" shares the
    kernels' expert-sorted order and float32 accumulation; "loop" is the oracle and should not be replaced);
    block_configs: (block_m, block_n, block_k) per Triton choice, powers of two >= 16.

    Raises: ValueError for an unknown impl or a block size below 16 / not a power of two.
    """
    from torch._inductor.kernel.custom_op import autotune_custom_op
    from torch._inductor.lowering import user_lowerings

    from ..kernels.moe.op import MOE_IMPLS

    unknown = set(impls) - set(MOE_IMPLS)
    if unknown:
        raise ValueError(f"register_moe_lowering: impls must be among {MOE_IMPLS}, got {sorted(unknown)}")
    for blocks in block_configs:
        if len(blocks) != 3 or any(b < 16 or b & (b - 1) for b in blocks):
            raise ValueError(f"register_moe_lowering: block_configs entries are 3 powers of two >= 16, got {blocks}")
    op = torch.ops.dgemma.moe_experts.default
    fallback = _fallback_op()
    _state.setdefault("previous", user_lowerings.get(op))
    kwargs_list = [{}] + [dict(block_m=m, block_n=n, block_k=k) for m, n, k in block_configs]
    decompositions = [_grouped_choice] + [_triton_choice] * len(block_configs)

    def lowering(*args, **kwargs):
        tensors, impl, quant = _call_args(args, kwargs)
        if impl not in impls or expert_format(quant).quantized or tensors[0].get_device().type != "cuda":
            return None  # Inductor's usual lowering (its fallback kernel for this op)
        result, _choice = autotune_custom_op(name="dgemma_moe_experts", decompositions=decompositions,
                                             inputs=tensors, non_tensor_args=kwargs_list, op_overload=fallback)
        return result

    lowering._dgemma_moe = True
    user_lowerings[op] = lowering


def unregister_moe_lowering() -> None:
    """Remove the entry `register_moe_lowering` installed (restoring any user lowering it replaced); no-op if none."""
    from torch._inductor.lowering import user_lowerings

    op = torch.ops.dgemma.moe_experts.default
    if getattr(user_lowerings.get(op), "_dgemma_moe", False):
        previous = _state.pop("previous", None)
        if previous is None:
            del user_lowerings[op]
        else:
            user_lowerings[op] = previous


def moe_lowering_registered() -> bool:
    """Whether `register_moe_lowering`'s entry is installed."""
    from torch._inductor.lowering import user_lowerings

    return getattr(user_lowerings.get(torch.ops.dgemma.moe_experts.default), "_dgemma_moe", False)
