"""Our kernels, one folder per capability, each beside what it replaces: the op (`torch.ops.dgemma.*`, with a schema,
a fake (meta) implementation and a CPU implementation in plain torch, so every compiled graph still compiles without
a GPU), its kernels and the graph pass that puts it in a compiled step.

- `moe/`: `dgemma::moe_experts`, the routed experts of one MoE layer (`moe/op.py`: a selectable implementation,
  `MOE_IMPLS` and the rule `resolve_moe_impl`, the Inductor decompositions of its sync-free ones, and the
  `dgemma::materialize` barriers: plain `torch.library.Library` kernels, cheaper to call, reason there), and the
  experts' stored weight formats (`moe/formats.py`).
- `sample/`: `dgemma::sample_step`, the vocabulary-wide region of a denoise step (`sample/op.py`; the oracle math is
  `step/sampler.py`), its Triton kernel (`sample/triton_kernel.py`, CUDA), the graph pass that puts it in place of that
  region (`sample/fusion.py`) and its vocabulary-parallel twin (`sample/vocab_parallel.py`).

Code no default path reaches and no GPU has verified is in `dgemma_compile/experimental/`. Importing this package
registers the ops (not the Triton kernels: triton is only in the `test` extra).
"""

from .moe import op as moe  # noqa: F401  (registers torch.ops.dgemma.moe_experts and the materialize barriers)
from .moe.op import (MOE_IMPLS, moe_cache_key, moe_decompositions, moe_experts, moe_experts_dense, moe_experts_grouped,
                     moe_experts_loop, resolve_moe_impl)
from .sample import op as sample  # noqa: F401  (registers torch.ops.dgemma.sample_step)

__all__ = ["MOE_IMPLS", "moe_cache_key", "moe_decompositions", "moe_experts", "moe_experts_dense",
           "moe_experts_grouped", "moe_experts_loop", "resolve_moe_impl"]
