"""Custom ops (`torch.ops.dgemma.*`): each with a schema, a fake (meta) implementation and a CPU implementation in
plain torch (the oracle), so every compiled graph still compiles without a GPU. Each is a `torch.library.custom_op`,
except `dgemma::materialize` and `dgemma::materialize_many` (`moe.py`: plain `torch.library.Library` kernels, cheaper
to call, reason there).

- `moe.py`: `dgemma::moe_experts`, the routed experts of one MoE layer, with a selectable implementation
  (`MOE_IMPLS`, the rule `resolve_moe_impl`) and the Inductor decompositions of its sync-free ones
  (`moe_decompositions`).
- `sample.py`: `dgemma::sample_step`, the vocabulary-wide region of a denoise step (`sampler.sample_step`), which
  the graph pass `passes.sample_step_fusion` puts in place of that region.

Importing this package registers the ops.
"""

from . import moe, sample  # noqa: F401  (register torch.ops.dgemma.moe_experts, .sample_step)
from .moe import (MOE_IMPLS, moe_cache_key, moe_decompositions, moe_experts, moe_experts_dense, moe_experts_grouped,
                  moe_experts_loop, resolve_moe_impl)

__all__ = ["MOE_IMPLS", "moe_cache_key", "moe_decompositions", "moe_experts", "moe_experts_dense",
           "moe_experts_grouped", "moe_experts_loop", "resolve_moe_impl"]
