"""Custom ops that enter compiled graphs opaquely, each with its eager reference implementation.

`dgemma::moe_experts` runs the routed experts of one MoE layer. Its implementation is the transformers
reference loop (only the experts that received tokens, accumulated in expert order), which has data-dependent
shapes; as a custom op with a fake (meta) implementation it keeps `fullgraph=True` compiles whole while giving
bit-identical results to eager. A sync-free grouped-GEMM implementation for CUDA belongs beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("dgemma::moe_experts", mutates_args=())
def moe_experts(x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_EID: torch.Tensor,
                down_EDI: torch.Tensor) -> torch.Tensor:
    """sum_k w[n, k] * down[e] @ (gelu_tanh(gate[e] @ x[n]) * (up[e] @ x[n])), e = idx[n, k].

    Args: x [N, D] (model dtype), w [N, K] float32 routing weights, idx [N, K] int64 expert ids,
    gate_up [E, 2I, D] (gate rows first), down [E, D, I]. Returns [N, D] in x's dtype.
    """
    out = torch.zeros_like(x_ND)
    for e in torch.unique(idx_NK).tolist():
        token, slot = torch.where(idx_NK == e)
        gate, up = F.linear(x_ND[token], gate_up_EID[e]).chunk(2, dim=-1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, down_EDI[e]) * w_NK[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


@moe_experts.register_fake
def _(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
    return torch.empty_like(x_ND)
