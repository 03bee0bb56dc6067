"""`compile/lowerings.py`: the materialize barriers compiled as generated copies, not calls back into Python.

A function whose RMSNorm feeds a per-row weight loop through `materialize` (the shape of `moe_experts_gathered`),
compiled by Inductor with the lowerings registered: the generated code has no call of the op (no extern kernel, no
Python callback) and its values are, bit for bit, those of the same function compiled with the op left to Inductor's
default (an extern call of its Python kernel: what the steps ran before the lowerings). `materialize_many` likewise.
"""

from __future__ import annotations

import contextlib

import torch
from torch._inductor import lowering as inductor_lowering
from torch._inductor.utils import run_and_get_code

from dgemma_compile.compile import lowerings
from dgemma_compile.kernels.moe.op import materialize, materialize_many

OPS = (torch.ops.dgemma.materialize.default, torch.ops.dgemma.materialize_many.default)


def _norm_then_rows(x_ND, w_ID):
    y_ND = materialize(torch.rsqrt(x_ND.pow(2).mean(-1, keepdim=True) + 1e-6) * x_ND)
    return (y_ND[:, None, :] * w_ID).sum(-1)


def _many(a, b):
    a2, b2 = materialize_many([a * 2 + 1, b.cumsum(0)])
    return a2[:, None] * b2[None, :]


@contextlib.contextmanager
def _default_lowering():
    """The ops without our lowerings (Inductor then makes its extern fallback); ours restored after, and the
    fallback's traces in Inductor's other tables removed (later compiles in this process run as in production)."""
    lowerings.register()
    saved = {op: inductor_lowering.lowerings.pop(op) for op in OPS}
    try:
        yield
    finally:
        inductor_lowering.lowerings.update(saved)
        for op in OPS:
            inductor_lowering.fallbacks.discard(op)
            inductor_lowering.needs_realized_inputs.discard(op)
            getattr(inductor_lowering, "_maybe_layout_constraints", {}).pop(op, None)


def _compiled(fn, *args) -> tuple[torch.Tensor, str]:
    torch.compiler.reset()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(code)


def _both(fn, *args) -> tuple[tuple[torch.Tensor, str], tuple[torch.Tensor, str]]:
    lowerings.register()
    ours = _compiled(fn, *args)
    with _default_lowering():
        default = _compiled(fn, *args)
    return ours, default


def _no_barrier(x_ND, w_ID):
    y_ND = torch.rsqrt(x_ND.pow(2).mean(-1, keepdim=True) + 1e-6) * x_ND
    return (y_ND[:, None, :] * w_ID).sum(-1)


def test_materialize_is_a_generated_copy_with_the_extern_calls_values():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 128, generator=g), torch.randn(256, 128, generator=g)
    (out, code), (want, default_code) = _both(_norm_then_rows, x, w)
    assert "dgemma.materialize" in default_code  # the default: a call of the op's Python kernel
    assert "dgemma.materialize" not in code  # ours: none
    assert torch.equal(out, want)
    torch.testing.assert_close(out, _norm_then_rows(x, w))
    # the barrier holds: the normalised [16, 128] rows get a buffer of their own, which the weight loop loads;
    # without it Inductor inlines the normalisation into that loop (no such buffer)
    _, plain_code = _compiled(_no_barrier, x, w)
    alloc = "empty_strided_cpu((16, 128)"
    assert alloc in code and alloc not in plain_code


def test_materialize_many_is_generated_copies_with_the_extern_calls_values():
    a, b = torch.arange(8, dtype=torch.float32), torch.linspace(0, 1, 5)
    (out, code), (want, default_code) = _both(_many, a, b)
    assert "dgemma.materialize_many" in default_code and "dgemma.materialize_many" not in code
    assert torch.equal(out, want) and torch.equal(out, _many(a, b))
