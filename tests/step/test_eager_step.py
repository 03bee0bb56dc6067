"""The one step run uncompiled (`mixed_step.mixed_step` over a `RowTable` with no unit, or a compiled generator's steps held
by `defer()`): what makes it fast keeps its numbers. Dense masks equal to what FlexAttention sees, the plan left as
it is when its inputs are unchanged, one Philox call for the step's noise, bitwise-equal norms, the experts' eager
implementation; and its tokens are the eager oracle's and the compiled step's on demo prompts.

Legend: B rows, T block tokens, S committed slots.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dgemma_compile as dg
from dgemma_compile.step import rng
from dgemma_compile.step.row_table import RowTable
from dgemma_compile.compile import CompileOptions, build
from dgemma_compile.demo import tasks
from dgemma_compile.step.finish import finalize_row
from dgemma_compile.step.requests import RequestStats
from dgemma_compile.model.masks import block_mask_mod, dense_mask, flex_block_attention, make_block_mask
from dgemma_compile.model.backbone import RMSNorm, eager_attention, rms_normalize
from dgemma_compile.kernels.moe import op as ops_moe
from dgemma_compile.model.modes import DENOISER, ENCODER, IDLE
from dgemma_compile.model.plan import PlanBuffers, build_plan

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")


def _heldout(tok, n: int, offset: int = 0) -> list[list[int]]:
    return [tok(p)["input_ids"] for _, p, _ in tasks.make_split("heldout", n, seed=0, offset=offset)]


# ----- the step's noise: one Philox call -------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4), st.integers(0, 2**33), st.integers(0, 2**33),
       st.integers(1, 20), st.sampled_from([1, 27, 1000, 262144, 2**31]))
def test_step_streams_are_the_start_canvas_and_the_step_noise(seeds, block, step, C, V):
    seeds_B = rng.seed_tensor(seeds)
    B = len(seeds)
    for blk, stp in ((torch.tensor(block), torch.tensor(step)),
                     (torch.arange(B) + block, torch.arange(B) * 3 + step)):
        start, uniform, renoise = rng.step_streams(seeds_B, blk, stp, C, V)
        u, r = rng.step_noise(seeds_B, blk, stp, C, V)
        assert torch.equal(start, rng.start_canvas(seeds_B, blk, C, V))
        assert torch.equal(uniform, u) and torch.equal(renoise, r)


def test_step_streams_traced_are_the_numpy_streams():
    """Traced (the int64 tensor version a compiled step runs) and uncompiled on CPU (NumPy's uint64): the same words."""
    torch.compiler.reset()
    traced = torch.compile(rng.step_streams, backend="eager", fullgraph=True)
    seeds_B = rng.seed_tensor([0, 2**64 - 1, 2**63 + 5])
    for block, step, V in ((torch.tensor([0, 1, 2**33]), torch.tensor([16, 1, 0]), 27),
                           (torch.tensor([5, 5, 5]), torch.tensor([-1, 2**40, 3]), 262144)):
        want = rng.step_streams(seeds_B, block, step, 16, V)
        assert all(torch.equal(a, b) for a, b in zip(traced(seeds_B, block, step, 16, V), want))


# ----- norms: torch's kernel eagerly, shared normalizations ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 16, 128), (8, 16, 4, 32), (3, 64), (2, 16, 2816)])
def test_norms_are_bitwise_the_reference_formula(dtype, shape):
    """`RMSNorm` eagerly (torch's rms_norm kernel in float32) and `scale(rms_normalize(x))` (a normalization shared
    by several norms of x) give the reference formula's bits: x * (mean(x^2) + eps)^-0.5 * weight in float32."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    for with_scale in (True, False):
        norm = RMSNorm(shape[-1], 1e-6, with_scale=with_scale)
        if with_scale:
            norm.weight.data = torch.randn(shape[-1], generator=g)
        xf = x.float()
        ref = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
        ref = (ref if norm.weight is None else ref * norm.weight.float()).type_as(x)
        with torch.inference_mode():
            assert torch.equal(norm(x), ref)
            assert torch.equal(norm.scale(rms_normalize(x, norm.eps), x), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_attention_is_flex_attentions_eager_math_bitwise(dtype):
    """`eager_attention` on a block mask's dense mask gives FlexAttention's uncompiled output bit for bit (GQA ratios
    1, 2, 4, mixed per-row masks with and without a window, a transposed query as the model passes it)."""
    g = torch.Generator().manual_seed(0)
    for B, H, Hkv, D, T, S, W in ((1, 4, 2, 32, 16, 256, 16), (2, 4, 1, 64, 16, 40, None), (3, 8, 8, 16, 32, 24, 8),
                                  (2, 4, 2, 32, 1, 9, None)):
        mm = block_mask_mod(torch.randint(0, S + 1, (B,), generator=g), torch.randint(0, T + 1, (B,), generator=g),
                            torch.rand(B, generator=g) > 0.5, cache_slots=S, sliding_window=W)
        bm = make_block_mask(mm, B, T, S, "cpu")
        q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
        k, v = (torch.randn(B, Hkv, S + T + 3, D, generator=g).to(dtype)[:, :, :S + T] for _ in range(2))
        with torch.no_grad():
            flex = flex_block_attention(q.contiguous(), k, v, bm)
            assert torch.equal(eager_attention(q, k, v, dense_mask(bm)), flex)


# ----- the experts' eager implementation -------------------------------------------------------------------------

def test_gathered_runs_grouped_eagerly_on_cpu_and_as_itself_compiled():
    x = torch.randn(16, 32)
    assert ops_moe.eager_impl("gathered", "none", x) == "grouped"
    assert ops_moe.eager_impl("gathered", "none", x.bfloat16()) == "grouped"
    assert ops_moe.eager_impl("gathered", "fp8", x) == "gathered"  # grouped takes unquantized experts only
    assert ops_moe.eager_impl("gathered", "none", x.half()) == "gathered"
    for impl in ("loop", "dense", "grouped"):
        assert ops_moe.eager_impl(impl, "none", x) == impl
    g = torch.Generator().manual_seed(1)
    E, K, D, I = 8, 2, 32, 24
    w = torch.softmax(torch.randn(16, K, generator=g), -1)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(16)])
    gate_up, down = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    args = (x, w, idx, gate_up, [], down, [])
    out = torch.ops.dgemma.moe_experts(*args, "gathered", "none")
    assert torch.equal(out, torch.ops.dgemma.moe_experts(*args, "grouped", "none"))
    assert torch.equal(ops_moe.run_eager(*args, "gathered", "none"), out)
    torch.testing.assert_close(ops_moe.moe_experts_gathered(x, w, idx, gate_up, down), out, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="moe_impl"):
        ops_moe.run_eager(*args, "fast", "none")


# ----- the plan of an uncompiled step ----------------------------------------------------------------------------

def _mixed(model, B=3, S=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = model.config.canvas_length
    cache = model.new_cache(B, S)
    cache.lengths.copy_(torch.tensor([0, 7, 23][:B]))
    mode = torch.tensor([ENCODER, DENOISER, IDLE][:B])
    n_new = torch.tensor([5, 0, 0][:B])
    sc = torch.tensor([False, True, False][:B])
    ids = torch.randint(3, model.config.vocab_size, (B, C), generator=g)
    return cache, mode, n_new, sc, ids


def test_eager_plan_masks_are_what_flex_attention_sees(tiny_dir):
    """`PlanBuffers.eager_plan`: each block mask replaced by its dense mask, equal to `build_plan`'s dense masks (a
    dense-attention model's) and to the block mask's own mask_mod everywhere its sparsity lets FlexAttention look;
    kept from the latest eager fill while the captured values are unchanged, evaluated again when they change without
    a fill; the forward over it matches FlexAttention's."""
    model = dg.load(tiny_dir)
    cache, mode, n_new, sc, ids = _mixed(model)
    buffers = PlanBuffers(model, cache, ids.shape[1], mixed=True, sparsity_in_place=True)
    buffers.fill(mode, n_new, sc)
    eager = buffers.eager_plan()
    reference = build_plan(model, cache, ids.shape[1], mode=mode, n_new=n_new, self_conditioning=sc,
                           dense_masks=True)
    for lt, mask in buffers.plan.masks.items():
        assert torch.equal(eager.masks[lt], reference.masks[lt])
        assert torch.equal(dense_mask(mask), reference.masks[lt])
    assert buffers.eager_plan().masks is eager.masks  # the latest fill's, reused
    cache.lengths[1] += 1  # a change the plan was not refilled for: evaluated now, from the new values
    moved = buffers.eager_plan()
    assert moved.masks is not eager.masks
    for lt, mask in buffers.plan.masks.items():
        assert torch.equal(moved.masks[lt], dense_mask(mask))
    cache.lengths[1] -= 1
    with torch.no_grad():
        flex = model.forward_plan(ids, cache, buffers.plan)
        cache.lengths.sub_(buffers.plan.commit)
        dense = model.forward_plan(ids, cache, buffers.eager_plan())
    assert torch.equal(dense, flex)  # FlexAttention's eager math on the dense masks: the same bits


def test_an_unchanged_plan_is_not_rebuilt_and_a_changed_one_is(tiny_dir):
    """`fill` with the inputs the buffers were filled from (and the same lengths) leaves every buffer as it is (an
    eager step's denoise iterations); any other input refills them, to what a fresh plan holds."""
    model = dg.load(tiny_dir)
    cache, mode, n_new, sc, ids = _mixed(model)
    buffers = PlanBuffers(model, cache, ids.shape[1], mixed=True, sparsity_in_place=True)
    buffers.fill(mode, n_new, sc)
    before = [t.clone() for t in buffers.tensors]
    assert buffers._holds(mode, n_new, sc)
    buffers.fill(mode.clone(), n_new.clone(), sc.clone())
    assert all(torch.equal(a, b) for a, b in zip(buffers.tensors, before))
    for change in ("sc", "lengths"):
        if change == "sc":
            sc = sc.clone()
            sc[1] = False
        else:
            cache.lengths[2] += 3
        assert not buffers._holds(mode, n_new, sc)
        buffers.fill(mode, n_new, sc)
        fresh = PlanBuffers(model, cache, ids.shape[1], mixed=True, sparsity_in_place=True)
        fresh.fill(mode, n_new, sc)
        assert all(torch.equal(a, b) for a, b in zip(buffers.tensors, fresh.tensors)), change


# ----- tokens -----------------------------------------------------------------------------------------------------

def test_the_eager_step_gives_the_eager_oracles_tokens(demo):
    """The deferred (uncompiled) step -- dense masks, the experts' eager implementation, norms, noise in one draw --
    against the readable eager loop on demo test prompts, at batch 1 and 2: the same tokens and stats."""
    model, tok = demo
    prompts = _heldout(tok, 4)
    seeds = list(range(10, 14))
    gen = build(model, CompileOptions(batch_buckets=(1, 2), max_seq_len=256))
    oracle = dg.generate(model, prompts, seed=seeds, moe_impl=gen.moe_impl)
    gen.defer()
    for rows in ([0], [1, 2, 3]):
        out = gen.generate([prompts[r] for r in rows], seed=[seeds[r] for r in rows])
        assert out.sequences == [oracle.sequences[r] for r in rows]
        assert [s.steps_per_block for s in out.stats] == [oracle.stats[r].steps_per_block for r in rows]
    assert gen.step_source == "eager" and sum(gen.compiles.values()) == 0


def test_an_eager_bucket_serves_the_deferred_steps_tokens(demo):
    """A `RowTable` with no unit (dense plan masks from the start, no block sparsity: `dgemma serve --eager`'s) steps
    the same tokens as a compiled generator's held steps (block masks, the dense ones derived each step)."""
    model, tok = demo
    prompts = _heldout(tok, 3, offset=20)
    gen = build(model, CompileOptions(batch_buckets=(1,), max_seq_len=256))
    gen.defer()
    held = gen.generate(prompts, seed=[3, 4, 5])
    cfg = model.generation_config.resolved(model.config)
    row_table = RowTable(model, (1,), max_seq_len=256, max_denoising_steps=256, config=cfg, moe_impl=gen.moe_impl)
    view = row_table.view(1)
    assert all(isinstance(m, torch.Tensor) for m in view.plan.plan.masks.values())
    for p, prompt in enumerate(prompts):
        row_table.clear()
        row_table.admit(0, prompt, cfg, 3 + p)
        view.refresh()
        sequence, stats, done = [], RequestStats(), False
        while not done:
            view.step()
            report = view.report()[0]
            if report.event:
                argmax = row_table.read_blocks([0])[0]
                _, done = finalize_row(argmax, cfg, sequence, stats, report.steps)
                assert done == report.done
        assert sequence == held.sequences[p] and stats.steps_per_block == held.stats[p].steps_per_block


@pytest.mark.slow
def test_the_eager_step_gives_the_compiled_steps_tokens(demo, demo_gen):
    """The step that answers while the compiled one compiles (`defer()`) against the compiled step itself, at batch
    1 and 2 over demo test prompts: the same tokens (bench/results/eager_step_cpu_2026-12-03.md: all 500)."""
    model, tok = demo
    prompts = _heldout(tok, 8, offset=40)
    seeds = list(range(8))
    compiled = demo_gen.generate(prompts, seed=seeds)
    gen = build(model, CompileOptions(batch_buckets=demo_gen.options.batch_buckets, max_seq_len=256))
    gen.defer()
    eager = gen.generate(prompts, seed=seeds)
    assert gen.step_source == "eager"
    assert eager.sequences == compiled.sequences and eager.stats == compiled.stats
