"""Inductor lowerings of our own ops: what a compiled step runs for them instead of a call back into Python.

`dgemma::materialize` / `materialize_many` (`kernels.moe.op`) are copies that a graph must store in buffers of their
own, so that Inductor does not inline their producers into loop nests that would recompute them per element (the
reasons are at their call sites: `moe_experts_gathered`, `plan.PlanBuffers._fill_sparsity`). Left to Inductor's
default, a custom op it has no lowering for becomes an extern call of its Python kernel: five calls a step, each
through the dispatcher into the interpreter (and, in an AOTInductor package, through its proxy executor), ~15-30 us
apiece on CPU, ~8% of the demo's batch-1 step. Lowered here, each is a realized copy: a buffer Inductor computes
in generated code (fused with its producer where it can be), which its consumers load and never recompute -- the
barrier the op exists for, without leaving the generated code. The values are the eager op's: a copy.

`register()` installs them into Inductor's lowering table once per process, when the first graph compiles (importing
Inductor costs seconds that an eager or loaded step must not pay). The compile cache's step key covers this file
with every other compile source.
"""

from __future__ import annotations

import functools
import importlib

import torch


@functools.cache
def register() -> None:
    """Install the lowerings (idempotent)."""
    from torch._inductor import ir
    from torch._inductor import lowering as L

    importlib.import_module("..kernels.moe.op", __package__)  # defines torch.ops.dgemma.materialize*

    def realized_copy(x):
        y = L.clone(x)  # a pointwise copy: x's producer may fuse into it
        y.realize()  # ... but into this buffer, which consumers load
        return ir.ExternKernel.require_contiguous(y)  # the op's contract (its fake: contiguous_format)

    L.register_lowering(torch.ops.dgemma.materialize.default, type_promotion_kind=None)(realized_copy)
    L.register_lowering(torch.ops.dgemma.materialize_many.default, type_promotion_kind=None)(
        lambda xs: [realized_copy(x) for x in xs])
