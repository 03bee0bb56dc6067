"""The CUDA (sync-free) MoE implementations against the reference loop, run here on CPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgemma_compile import ops


@settings(max_examples=20)
@given(N=st.integers(1, 40), E=st.integers(1, 8), K=st.integers(1, 4), seed=st.integers(0, 1000))
@pytest.mark.parametrize("impl", [ops.moe_experts_grouped, ops.moe_experts_dense])
def test_sync_free_moe_matches_loop(impl, N, E, K, seed):
    K = min(K, E)
    g = torch.Generator().manual_seed(seed)
    D, I = 16, 8
    x = torch.randn(N, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g)
    gate_up, down = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    ref = torch.ops.dgemma.moe_experts(x, w, idx, gate_up, down)
    torch.testing.assert_close(impl(x, w, idx, gate_up, down), ref, atol=1e-4, rtol=1e-5)
