"""Expert parallel (`parallel/expert_parallel.py`, docs/parallel.md "Experts: which split"), fast and in one process:
the ranks' partial sums of a layer's routed experts, each over its E/N whole experts, add up to the single-process
op for every `moe_impl`; the split refuses an expert count it cannot divide and an unknown split, naming them; the
CLI takes `--experts-split`. The 2- and 4-rank gloo runs of the sharded model are in tests/parallel/test_parallel.py (slow)."""

from __future__ import annotations

import pytest
import torch

from dgemma_compile.kernels.moe.op import MOE_IMPLS
from dgemma_compile.parallel.expert_parallel import (ExpertParallelExperts, check_expert_parallel, check_expert_split,
                                                     expert_range, local_routing)
from dgemma_compile.parallel.experts import TensorParallelExperts


@pytest.fixture(scope="module")
def layer_inputs(demo):
    """The demo's layer-0 experts (8 of them, top 2) and 40 tokens routed by its own router."""
    model, _ = demo
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, model.config.hidden_size, generator=g)
    with torch.no_grad():
        w, idx = model.layers[0].router(torch.randn(40, model.config.hidden_size, generator=g) * 3)
    return model.layers[0].experts, x, w, idx


@pytest.mark.parametrize("impl", MOE_IMPLS)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_partial_sums_add_up_to_the_single_process_experts(layer_inputs, impl, world):
    experts, x, w, idx = layer_inputs
    with torch.no_grad():
        want = experts(x, w, idx, impl)
        parts = [ExpertParallelExperts(experts, r, world, None, "layers.0.experts").partial(x, w, idx, impl)
                 for r in range(world)]
    assert all(p.shape == want.shape and p.dtype == want.dtype for p in parts)
    got = torch.stack(parts).sum(0)
    # each token's 2 terms now added across ranks: float32 rounding of one addition, relative to |y| <= ~60
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), impl
    # every rank's part is real work: leaving one out is an O(1) error
    assert float((got - parts[0] - want).abs().max()) > 0.1 * float(want.abs().max())


def test_a_rank_holds_its_whole_experts_and_only_those(layer_inputs):
    experts, *_ = layer_inputs
    gu, down = experts.gate_up_proj.weight, experts.down_proj.weight
    for r in range(4):
        ep = ExpertParallelExperts(experts, r, 4, None, "layers.0.experts")
        assert (ep.start, ep.count) == (2 * r, 2)
        assert torch.equal(ep.gate_up_proj.weight, gu[2 * r:2 * r + 2])
        assert torch.equal(ep.down_proj.weight, down[2 * r:2 * r + 2])
        tp = TensorParallelExperts(experts, r, 4, None, "layers.0.experts")  # the other split: same bytes a rank
        assert ep.gate_up_proj.weight.numel() == tp.gate_up_proj.weight.numel() == gu.numel() // 4


def test_local_routing_keeps_only_the_ranks_assignments():
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    idx = torch.tensor([[5, 1], [2, 3]])
    lw, li = local_routing(w, idx, start=2, count=2, impl="gathered")  # experts 2 and 3
    assert torch.equal(lw, torch.tensor([[0.0, 0.0], [0.7, 0.3]])) and torch.equal(li, torch.tensor([[0, 0], [0, 1]]))
    lw, li = local_routing(w, idx, start=4, count=2, impl="loop")  # experts 4 and 5; the others get id 2 (skipped)
    assert torch.equal(lw, torch.tensor([[0.6, 0.0], [0.0, 0.0]])) and torch.equal(li, torch.tensor([[1, 2], [2, 2]]))


def test_an_expert_count_that_cannot_be_split_is_refused_naming_the_tensor(layer_inputs):
    experts, *_ = layer_inputs
    with pytest.raises(ValueError, match=r"layers\.3\.experts\.gate_up_proj\.weight holds 8 experts, which cannot be "
                                         r"split over 3 ranks by expert"):
        check_expert_parallel(experts, 3, "layers.3.experts")
    with pytest.raises(ValueError, match=r"layers\.3\.experts\.gate_up_proj\.weight holds 8 experts"):
        ExpertParallelExperts(experts, 0, 3, None, "layers.3.experts")
    assert expert_range(128, 3, 8, "x") == (48, 16)  # the release: 16 experts a rank at 8 ranks
    with pytest.raises(ValueError, match=r"experts must be one of \('tensor', 'expert'\), got 'rows'"):
        check_expert_split("rows")


def test_cli_takes_the_experts_split():
    from dgemma_compile.cli import _parser

    p = _parser()
    args = p.parse_args(["generate", "--tensor-parallel-size", "2", "--experts-split", "expert", "x"])
    assert args.experts_split == "expert"
    assert p.parse_args(["serve"]).experts_split == "tensor"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--experts-split", "rows", "x"])


@pytest.mark.parametrize("quant,split", [("fp8-weight-only", "tensor"), ("nvfp4-w4a16", "tensor"),
                                         ("fp8-weight-only", "expert"), ("nvfp4-w4a16", "expert"),
                                         ("fp8", "expert")])
@pytest.mark.parametrize("impl", ["loop", "gathered"])
def test_quantized_experts_split_into_partial_sums_of_the_single_process_op(layer_inputs, quant, split, impl):
    """Quantized experts keep their format on each rank (`parallel/quantized.py`: codes and scales sliced with the
    rows, columns or experts they cover): the ranks' parts add up to the single-process quantized op. fp8 with
    dynamic activations only whole experts: the tensor split's down_proj would scale each rank's slice of the
    intermediate activations on its own (docs/parallel.md, "Quantized weights")."""
    import copy

    from dgemma_compile.model.backbone import Experts
    from dgemma_compile.quant.schemes import scheme

    experts, x, w, idx = layer_inputs
    q = copy.deepcopy(experts)
    for proj, parts in ((q.gate_up_proj, 2), (q.down_proj, 1)):
        proj.set_quantized(scheme(quant).experts, *scheme(quant).expert_weights(proj.weight.detach(), parts=parts))
    world = 2
    with torch.no_grad():
        want = q(x, w, idx, impl)
        if split == "tensor":
            ranks = [TensorParallelExperts(q, r, world, None, "layers.0.experts") for r in range(world)]
            parts = [Experts.forward(tp, x, w, idx, impl) for tp in ranks]  # the rank's part, before its all-reduce
        else:
            ranks = [ExpertParallelExperts(q, r, world, None, "layers.0.experts") for r in range(world)]
            parts = [ep.partial(x, w, idx, impl) for ep in ranks]
    assert all(r.quant == quant for r in ranks)
    got = torch.stack(parts).sum(0)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (quant, split, impl)
    assert float((got - parts[0] - want).abs().max()) > 0.1 * float(want.abs().max())
    assert float((want - experts(x, w, idx, impl)).abs().max()) > 1e-3 * float(want.abs().max())  # quantized indeed
