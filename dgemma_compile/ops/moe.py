"""`dgemma::moe_experts`: the routed experts of one MoE layer, with its eager reference implementation.

`dgemma::moe_experts` runs the routed experts of one MoE layer. On CPU its implementation is the transformers
reference loop (only the experts that received tokens, accumulated in expert order), which has data-dependent
shapes and host syncs; as a custom op with a fake (meta) implementation it keeps `fullgraph=True` compiles whole
while giving bit-identical results to eager. On CUDA the op runs sync-free with static shapes, so that the denoise
step can be captured in a CUDA graph: tokens sorted by expert through `torch._grouped_mm` for bfloat16 (what the
grouped GEMM supports), otherwise every expert on every token weighted by a dense combine matrix (E/K times the
FLOPs; for small or float32 models). Both are checked against the loop on CPU.
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


def moe_experts_grouped(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
    """Sync-free experts: assignments sorted by expert, one grouped GEMM per projection, static shapes."""
    N, K = idx_NK.shape
    E = gate_up_EID.shape[0]
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // K
    counts = torch.zeros(E, dtype=torch.int32, device=x_ND.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x_ND[token], gate_up_EID.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.gelu(gate, approximate="tanh") * up, down_EDI.transpose(1, 2), offs=offs)
    y = y * w_NK.reshape(-1)[order, None]
    return torch.zeros_like(x_ND).index_add_(0, token, y.to(x_ND.dtype))


def moe_experts_dense(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
    """Sync-free experts: every expert on every token, combined with the routing weights (zero where unrouted)."""
    N, E = x_ND.shape[0], gate_up_EID.shape[0]
    combine_EN = torch.zeros(N, E, dtype=w_NK.dtype, device=x_ND.device).scatter(1, idx_NK, w_NK).T
    gate, up = torch.einsum("nd,eid->eni", x_ND, gate_up_EID).chunk(2, dim=-1)
    y_END = torch.einsum("eni,edi->end", F.gelu(gate, approximate="tanh") * up, down_EDI)
    return (y_END * combine_EN[..., None]).sum(0).to(x_ND.dtype)


@moe_experts.register_kernel("cuda")
def _(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
    impl = moe_experts_grouped if x_ND.dtype == torch.bfloat16 else moe_experts_dense
    return impl(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI)
